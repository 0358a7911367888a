// The page's entry point: the API key gate, then the two views (#chat, #engine).

import { APIError, auth, getJSON } from "./api.js";
import { Chat } from "./chat.js";
import { Dashboard } from "./dashboard.js";

const $ = (id) => document.getElementById(id);
let chat = null;
let dashboard = null;

function lock(message) {
  dashboard?.stop();
  auth.key = "";
  $("views").hidden = true;
  $("forget-key").hidden = true;
  $("status").textContent = "locked";
  $("status").dataset.state = "locked";
  $("lock").hidden = false;
  $("key-error").hidden = !message;
  $("key-error").textContent = message || "";
  $("key-input").focus();
}

function open() {
  $("lock").hidden = true;
  $("views").hidden = false;
  $("forget-key").hidden = !auth.required;
  const onUnauthorized = (err) => lock(err.message);
  chat ??= new Chat({ onUnauthorized });
  dashboard ??= new Dashboard({ onUnauthorized });
  dashboard.start();
  route();
}

function route() {
  const engine = location.hash === "#engine";
  $("view-chat").hidden = engine;
  $("view-engine").hidden = !engine;
  $("tab-chat").classList.toggle("active", !engine);
  $("tab-engine").classList.toggle("active", engine);
  if (!engine) $("prompt").focus();
}

// A key is taken once the API accepts it; a refusal shows the API's own message.
async function tryKey(key) {
  try {
    await getJSON("/v1/models", key);
    auth.key = key;
    open();
  } catch (err) {
    lock(err instanceof APIError ? err.message : String(err));
  }
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  tryKey($("key-input").value.trim());
});
$("forget-key").addEventListener("click", () => lock(""));
window.addEventListener("hashchange", route);

if (!auth.required) open();
else if (auth.key) tryKey(auth.key);
else lock("");
