// The Markdown a chat model writes, rendered as DOM nodes: fenced code blocks, headings, lists, block quotes,
// rules, paragraphs; inline code, bold, italic, strike-through and links. The text is only ever put into text
// nodes, so markup in the model's answer (<script>, <img onerror=...>) shows as the characters it is. A fence
// that is still open (the answer is streaming) renders as a code block so far.

import { copyButton, el } from "./dom.js";

const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^\s*>\s?(.*)$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const SAFE_URL = /^(https?:|mailto:)/i;

export function renderMarkdown(text) {
  const root = document.createDocumentFragment();
  blocks(text.replace(/\r\n?/g, "\n").split("\n"), root);
  return root;
}

function blocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i++;
    } else if ((m = FENCE.exec(line))) {
      const body = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(m[1]); i++) body.push(lines[i]);
      i++; // the closing fence
      parent.append(codeBlock(body.join("\n"), m[2]));
    } else if ((m = HEADING.exec(line))) {
      parent.append(inline(m[2], el(`h${Math.min(m[1].length + 2, 6)}`)));
      i++;
    } else if (RULE.test(line)) {
      parent.append(el("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const quoted = [];
      for (; i < lines.length && (m = QUOTE.exec(lines[i])); i++) quoted.push(m[1]);
      const quote = el("blockquote");
      blocks(quoted, quote);
      parent.append(quote);
    } else if ((m = ITEM.exec(line))) {
      i = list(lines, i, parent);
    } else {
      const para = [];
      for (; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i++) para.push(lines[i]);
      parent.append(paragraph(para));
    }
  }
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
}

// Consecutive items of one kind (bulleted or numbered); lines indented under an item continue it, and an
// item's own nested list renders inside it.
function list(lines, start, parent) {
  const first = ITEM.exec(lines[start]);
  const ordered = /\d/.test(first[2]);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
  const indent = first[1].length;
  let i = start;
  while (i < lines.length) {
    const m = ITEM.exec(lines[i]);
    if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
    const body = [m[3]];
    for (i++; i < lines.length; i++) {
      const next = ITEM.exec(lines[i]);
      const deeper = lines[i].length - lines[i].trimStart().length > indent;
      if (!lines[i].trim() || (next && !deeper) || (!next && !deeper && startsBlock(lines[i]))) break;
      body.push(deeper ? lines[i].slice(indent + 2) : lines[i]);
    }
    const item = el("li");
    blocks(body, item);
    // a one-paragraph item reads better without the paragraph's margins
    if (item.childNodes.length === 1 && item.firstChild.tagName === "P") item.replaceChildren(...item.firstChild.childNodes);
    node.append(item);
    while (i < lines.length && !lines[i].trim() && ITEM.test(lines[i + 1] || "")) i++;
  }
  parent.append(node);
  return i;
}

function paragraph(lines) {
  const p = el("p");
  lines.forEach((line, n) => {
    if (n) p.append(el("br"));
    inline(line, p);
  });
  return p;
}

export function codeBlock(code, language) {
  return el(
    "div",
    { className: "code" },
    el("div", { className: "code-bar" }, el("span", {}, language || "code"), copyButton(() => code)),
    el("pre", {}, el("code", { textContent: code })),
  );
}

// code spans first (their content is literal), then emphasis and links, whose text is parsed again
const INLINE =
  /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__|~~(?=\S)([\s\S]*?\S)~~|\*(?=[^\s*])([^*]*?[^\s*])\*|(?<!\w)_(?=[^\s_])([^_]*?[^\s_])_(?!\w)|\[([^\]\n]+)\]\(([^()\s]+)\)/g;

function inline(text, parent) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    parent.append(text.slice(last, m.index));
    last = m.index + m[0].length;
    if (m[1]) parent.append(el("code", { textContent: m[2] }));
    else if (m[3] || m[4]) parent.append(inline(m[3] || m[4], el("strong")));
    else if (m[5]) parent.append(inline(m[5], el("del")));
    else if (m[6] || m[7]) parent.append(inline(m[6] || m[7], el("em")));
    else if (SAFE_URL.test(m[9])) parent.append(inline(m[8], el("a", { href: m[9], rel: "noopener noreferrer", target: "_blank" })));
    else parent.append(m[0]); // a link to javascript: or the like stays text
  }
  parent.append(text.slice(last));
  return parent;
}
