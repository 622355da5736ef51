// A small markdown renderer for untrusted text (model output). It builds DOM nodes and puts
// every piece of text in with textContent / text nodes: markup in the input (<img onerror>,
// <script>) stays visible text, it never becomes an element. Links keep http(s)/mailto only.
// Covers what chat answers use: fenced code, headings, lists, quotes, rules, paragraphs,
// `code`, **bold**, *italic*, [links](https://...) and bare URLs.

const FENCE = /^\s*(```|~~~)\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^\s*>\s?(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
const INLINE = new RegExp([
  "(`+)([^`]|[^`][\\s\\S]*?[^`])\\1(?!`)",    // 1, 2: code span
  "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*",        // 3: bold
  "\\*(?=[^\\s*])([^*]*?[^\\s*])\\*",          // 4: italic
  "\\[([^\\]\\n]+)\\]\\(([^)\\s]+)\\)",         // 5, 6: link
  "(https?:\\/\\/[^\\s<>()\"']+[^\\s<>()\"'.,;:!?])", // 7: bare URL
].join("|"), "g");

function el(tag, parent, text) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

function safeHref(url) {
  return /^(https?:\/\/|mailto:)/i.test(url) ? url : null;
}

export function renderInline(text, parent) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) addText(parent, text.slice(last, m.index));
    if (m[2] !== undefined) el("code", parent, m[2]);
    else if (m[3] !== undefined) renderInline(m[3], el("strong", parent));
    else if (m[4] !== undefined) renderInline(m[4], el("em", parent));
    else if (m[5] !== undefined) link(parent, m[5], m[6], m[0]);
    else link(parent, m[7], m[7], m[0]);
    last = m.index + m[0].length;
  }
  if (last < text.length) addText(parent, text.slice(last));
}

// Line breaks inside a paragraph stay line breaks.
function addText(parent, text) {
  text.split("\n").forEach((line, i) => {
    if (i > 0) el("br", parent);
    if (line) parent.appendChild(document.createTextNode(line));
  });
}

function link(parent, label, url, raw) {
  const href = safeHref(url);
  if (href === null) {
    addText(parent, raw);
    return;
  }
  const a = el("a", parent, label);
  a.href = href;
  a.rel = "noopener noreferrer nofollow";
  a.target = "_blank";
}

// One block starting at lines[i]: appended to parent; returns the index after it.
function block(lines, i, parent) {
  const line = lines[i];
  let m;
  if ((m = FENCE.exec(line))) return codeBlock(lines, i, m, parent);
  if ((m = HEADING.exec(line))) {
    renderInline(m[2], el("h" + m[1].length, parent));
    return i + 1;
  }
  if (RULE.test(line)) {
    el("hr", parent);
    return i + 1;
  }
  if (QUOTE.test(line)) {
    const inner = [];
    while (i < lines.length && (m = QUOTE.exec(lines[i]))) { inner.push(m[1]); i++; }
    renderBlocks(inner, el("blockquote", parent));
    return i;
  }
  if (BULLET.test(line) || NUMBERED.test(line)) return list(lines, i, parent);
  return paragraph(lines, i, parent);
}

function codeBlock(lines, i, open, parent) {
  const body = [];
  let j = i + 1;
  // An unclosed fence (an answer still streaming) runs to the end.
  while (j < lines.length && !(FENCE.test(lines[j]) && FENCE.exec(lines[j])[2] === "")) {
    body.push(lines[j]);
    j++;
  }
  const code = el("code", el("pre", parent), body.join("\n"));
  if (open[2]) code.className = "language-" + open[2].replace(/[^\w-]/g, "");
  return j + 1;
}

function list(lines, i, parent) {
  const ordered = NUMBERED.test(lines[i]) && !BULLET.test(lines[i]);
  const pattern = ordered ? NUMBERED : BULLET;
  const node = el(ordered ? "ol" : "ul", parent);
  if (ordered) node.start = parseInt(NUMBERED.exec(lines[i])[1], 10);
  let item = null;
  while (i < lines.length && lines[i].trim() !== "") {
    const m = pattern.exec(lines[i]);
    if (m) {
      item = el("li", node);
      renderInline(ordered ? m[2] : m[1], item);
    } else if (/^\s+\S/.test(lines[i]) && item) {
      addText(item, "\n");
      renderInline(lines[i].trim(), item);
    } else break;
    i++;
  }
  return i;
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    BULLET.test(line) || NUMBERED.test(line);
}

function paragraph(lines, i, parent) {
  const body = [];
  while (i < lines.length && lines[i].trim() !== "" && (body.length === 0 || !startsBlock(lines[i]))) {
    body.push(lines[i]);
    i++;
  }
  renderInline(body.join("\n"), el("p", parent));
  return i;
}

function renderBlocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    if (lines[i].trim() === "") i++;
    else i = block(lines, i, parent);
  }
}

// The rendered text as a fragment of safe nodes.
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  renderBlocks(text.replace(/\r\n?/g, "\n").split("\n"), fragment);
  return fragment;
}
