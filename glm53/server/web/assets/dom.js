// Building DOM nodes. Text always goes in as text nodes: nothing on this page is ever parsed as HTML.

// el("p", {className: "x"}, "text", child) -> <p class="x">text<child></p>; strings become text nodes, null and
// false children are skipped. Properties are set as DOM properties (onclick, hidden, type, ...).
export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, props);
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return node;
}

export function svg(tag, attrs = {}) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  return node;
}

// The Clipboard API exists only in secure contexts (https, localhost); a page served at http://host:30000 is
// not one, so it falls back to copying a selected textarea.
export async function copyText(text, button) {
  try {
    if (navigator.clipboard && window.isSecureContext) await navigator.clipboard.writeText(text);
    else fallbackCopy(text);
    flash(button, "Copied");
  } catch {
    flash(button, "Copy failed");
  }
}

function fallbackCopy(text) {
  const area = el("textarea", { value: text, readOnly: true, className: "offscreen" });
  document.body.append(area);
  area.select();
  const ok = document.execCommand("copy");
  area.remove();
  if (!ok) throw new Error("copy refused");
}

function flash(button, label) {
  if (!button) return;
  const before = button.textContent;
  button.textContent = label;
  setTimeout(() => (button.textContent = before), 1200);
}

export function copyButton(getText, label = "Copy") {
  const button = el("button", { type: "button", className: "ghost small", textContent: label });
  button.addEventListener("click", () => copyText(getText(), button));
  return button;
}
