// The chat view: conversations (localStorage), one streamed answer at a time, stop and regenerate, settings.

import { APIError, streamChat } from "./api.js";
import { copyButton, el } from "./dom.js";
import { renderMarkdown } from "./markdown.js";
import * as store from "./store.js";

const NUMBERS = ["temperature", "max_tokens", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty"];
const $ = (id) => document.getElementById(id);

export class Chat {
  constructor({ onUnauthorized }) {
    this.onUnauthorized = onUnauthorized;
    this.conversations = store.loadConversations();
    this.settings = store.loadSettings();
    this.current = this.conversations[0] ?? null;
    this.controller = null; // the AbortController of the answer being streamed
    this.bindSettings();
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      this.send();
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        this.send();
      }
    });
    $("stop").addEventListener("click", () => this.controller?.abort());
    $("new-chat").addEventListener("click", () => this.select(null));
    $("toggle-history").addEventListener("click", () => $("history").classList.toggle("open"));
    $("toggle-settings").addEventListener("click", () => $("settings").classList.toggle("open"));
    $("close-settings").addEventListener("click", () => $("settings").classList.remove("open"));
    $("clear-chats").addEventListener("click", () => {
      if (!confirm("Delete every chat kept in this browser?")) return;
      this.conversations = [];
      this.save();
      this.select(null);
    });
    this.renderHistory();
    this.renderThread();
  }

  // ----- settings

  bindSettings() {
    for (const name of Object.keys(store.DEFAULT_SETTINGS)) {
      const input = $(`set-${name}`);
      if (input.type === "checkbox") input.checked = this.settings[name];
      else input.value = this.settings[name];
      input.addEventListener("input", () => {
        this.settings[name] = input.type === "checkbox" ? input.checked : input.value;
        store.saveSettings(this.settings);
        if (name === "tools") this.tools();
      });
    }
  }

  // The tools of the settings (null for none), or undefined when they are not a JSON array: the reason is then
  // shown beside the field, and nothing is sent.
  tools() {
    const text = this.settings.tools.trim();
    const error = $("tools-error");
    error.hidden = true;
    if (!text) return null;
    let tools;
    try {
      tools = JSON.parse(text);
    } catch (err) {
      error.textContent = `Tools: ${err.message}`;
    }
    if (tools !== undefined && !Array.isArray(tools)) {
      error.textContent = "Tools: a JSON array of tools is expected";
      tools = undefined;
    }
    error.hidden = tools !== undefined;
    return tools;
  }

  requestBody(messages) {
    const s = this.settings;
    const body = { messages: [], chat_template_kwargs: { enable_thinking: s.thinking } };
    if (s.system.trim()) body.messages.push({ role: "system", content: s.system });
    for (const m of messages) {
      const wire = { role: m.role, content: m.content || "" };
      if (m.tool_calls?.length) wire.tool_calls = m.tool_calls.map(({ id, name, arguments: args }) => ({ id, type: "function", function: { name, arguments: args } }));
      body.messages.push(wire);
    }
    for (const name of NUMBERS) if (s[name] !== "" && !Number.isNaN(Number(s[name]))) body[name] = Number(s[name]);
    const tools = this.tools();
    if (tools) body.tools = tools;
    return body;
  }

  // ----- conversations

  save() {
    store.saveConversations(this.conversations);
    this.renderHistory();
  }

  select(conversation) {
    if (this.controller) return; // one answer at a time; stop it first
    this.current = conversation;
    $("history").classList.remove("open");
    this.renderHistory();
    this.renderThread();
    $("prompt").focus();
  }

  renderHistory() {
    const list = $("conversations");
    list.replaceChildren(
      ...this.conversations.map((c) => {
        const remove = el("button", { type: "button", className: "ghost small", textContent: "×", title: "Delete this chat" });
        remove.addEventListener("click", (e) => {
          e.stopPropagation();
          this.conversations = this.conversations.filter((x) => x !== c);
          this.save();
          if (this.current === c) this.select(null);
        });
        const item = el("li", { className: c === this.current ? "active" : "" }, el("span", { textContent: c.title }), remove);
        item.addEventListener("click", () => this.select(c));
        return item;
      }),
    );
    $("thread-title").textContent = this.current?.title ?? "New chat";
  }

  renderThread() {
    const messages = this.current?.messages ?? [];
    $("messages").replaceChildren(...messages.map((m, i) => this.messageNode(m, i === messages.length - 1)));
    this.scroll(true);
  }

  // ----- sending

  // false when an answer is streaming, or the settings' tools are not valid JSON (their field says why)
  canSend() {
    if (this.controller) return false;
    if (this.tools() !== undefined) return true;
    $("settings").classList.add("open");
    return false;
  }

  async send() {
    const text = $("prompt").value;
    if (!text.trim() || !this.canSend()) return;
    if (!this.current) {
      this.current = store.newConversation();
      this.conversations.unshift(this.current);
    }
    if (!this.current.messages.length) this.current.title = text.trim().slice(0, 60);
    this.current.messages.push({ role: "user", content: text });
    $("prompt").value = "";
    await this.answer();
  }

  async regenerate() {
    const messages = this.current.messages;
    if (messages.at(-1)?.role !== "assistant" || !this.canSend()) return;
    messages.pop();
    await this.answer();
  }

  async answer() {
    const conversation = this.current;
    const body = this.requestBody(conversation.messages);
    const reply = { role: "assistant", content: "", reasoning: "", tool_calls: [], finish: null };
    conversation.messages.push(reply);
    this.save();
    this.renderThread();
    const view = this.lastMessageView();
    this.setStreaming(true);
    const started = performance.now();
    let first = null;
    let tokens = 0;
    try {
      for await (const chunk of streamChat(body, this.controller.signal)) {
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        for (const choice of chunk.choices) {
          const d = choice.delta;
          if ((d.content || d.reasoning_content || d.tool_calls) && first === null) first = performance.now();
          if (d.reasoning_content) reply.reasoning += d.reasoning_content;
          if (d.content) reply.content += d.content;
          for (const call of d.tool_calls ?? []) {
            const known = (reply.tool_calls[call.index] ??= { id: call.id, name: "", arguments: "" });
            if (call.function?.name) known.name = call.function.name;
            if (call.function?.arguments) known.arguments += call.function.arguments;
          }
          if (choice.finish_reason) reply.finish = choice.finish_reason;
        }
        view.update();
      }
      if (!reply.finish) reply.finish = "incomplete"; // the stream ended without a finish reason
    } catch (err) {
      if (err.name === "AbortError") reply.finish = "stopped";
      else {
        reply.finish = "error";
        reply.error = err.message;
        if (err instanceof APIError && err.status === 401) this.onUnauthorized(err);
      }
    }
    if (first !== null && tokens > 1) reply.stats = { ttft_s: (first - started) / 1000, tokens, tok_s: (tokens - 1) / ((performance.now() - first) / 1000) };
    this.setStreaming(false);
    this.save();
    if (this.current === conversation) view.update();
  }

  setStreaming(on) {
    this.controller = on ? new AbortController() : null;
    $("send").hidden = on;
    $("stop").hidden = !on;
  }

  lastMessageView() {
    const node = $("messages").lastElementChild;
    return { update: () => node.refresh() };
  }

  scroll(force = false) {
    const box = $("messages");
    // follow the answer unless the reader scrolled up to read something else
    if (force || box.scrollHeight - box.scrollTop - box.clientHeight < 80) box.scrollTop = box.scrollHeight;
  }

  // ----- one message

  messageNode(m, last) {
    const node = el("article", { className: `msg ${m.role}` });
    const reasoning = el("details", { className: "reasoning" }, el("summary", {}, "Reasoning"), el("div", { className: "reasoning-text" }));
    const content = el("div", { className: "content" });
    const calls = el("div", { className: "tool-calls" });
    const footer = el("footer");
    node.append(reasoning, content, calls, footer);
    let pending = false;
    let autoOpen = null; // what the page last set the reasoning block to; a reader's toggle differs from it
    const draw = () => {
      pending = false;
      const streaming = m.role === "assistant" && m.finish === null;
      node.dataset.state = m.role === "user" ? "done" : streaming ? "streaming" : m.finish;
      reasoning.hidden = !m.reasoning;
      reasoning.lastChild.textContent = m.reasoning || "";
      // open while the model thinks, folded once it answers (unless the reader opened or closed it)
      if (!reasoning.dataset.touched) reasoning.open = autoOpen = streaming && !m.content && !m.tool_calls?.length;
      content.replaceChildren(m.role === "user" ? el("p", { className: "plain", textContent: m.content }) : renderMarkdown(m.content || ""));
      calls.replaceChildren(...(m.tool_calls ?? []).map(toolCallNode));
      footer.replaceChildren(...this.footer(m, last, streaming));
      this.scroll();
    };
    reasoning.addEventListener("toggle", () => {
      if (reasoning.open !== autoOpen) reasoning.dataset.touched = "1";
    });
    // many deltas arrive between two frames: draw once a frame
    node.refresh = () => {
      if (!pending) {
        pending = true;
        requestAnimationFrame(draw);
      }
    };
    draw();
    return node;
  }

  footer(m, last, streaming) {
    if (streaming) return [el("span", { className: "muted" }, "…")];
    const parts = [];
    if (m.role === "assistant") {
      const notes = { stopped: "stopped", length: "cut at max tokens", error: "error", incomplete: "incomplete", tool_calls: "tool call" };
      if (notes[m.finish]) parts.push(el("span", { className: `finish ${m.finish}` }, notes[m.finish]));
      if (m.error) parts.push(el("span", { className: "error" }, m.error));
      if (m.stats) parts.push(el("span", { className: "muted" }, `${m.stats.tokens} tokens · ${m.stats.tok_s.toFixed(1)} tok/s · first token ${m.stats.ttft_s.toFixed(2)} s`));
    }
    parts.push(copyButton(() => m.content || ""));
    if (last && m.role === "assistant") {
      const again = el("button", { type: "button", className: "ghost small regenerate", textContent: "Regenerate" });
      again.addEventListener("click", () => this.regenerate());
      parts.push(again);
    }
    return parts;
  }
}

function toolCallNode(call) {
  let args = call.arguments;
  try {
    args = JSON.stringify(JSON.parse(args), null, 2);
  } catch {
    // still streaming, or not JSON: shown as it came
  }
  return el(
    "div",
    { className: "tool-call" },
    el("div", { className: "tool-name" }, el("span", { className: "muted" }, "tool call "), el("code", { textContent: call.name })),
    el("pre", { textContent: args }),
  );
}
