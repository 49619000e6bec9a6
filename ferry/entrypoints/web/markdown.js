// A small markdown renderer for model output: headings, paragraphs, fenced code, lists, quotes,
// rules, inline code, bold, italic and http(s) links.
//
// Model output is untrusted text. Every character of it is HTML-escaped before any markdown
// syntax is read, so the only tags in the result are the ones this file writes, and a link's
// address must start with http:// or https:// (no javascript: or data:). The page's
// Content-Security-Policy (no inline scripts) is the second wall.
"use strict";

(function () {
  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ESC[c]);

  // Inline markup of one escaped line. Code spans first, put aside so nothing inside them is
  // read as markup; then links, bold, italic.
  function inline(text) {
    const spans = [];
    text = text.replace(/`([^`]+)`/g, (_, code) => {
      spans.push("<code>" + code + "</code>");
      return "\u0000" + (spans.length - 1) + "\u0000";
    });
    text = text.replace(/\[([^\]]+)\]\((https?:\/\/[^\s()]+)\)/g,
      (_, label, href) => '<a href="' + href + '" target="_blank" rel="noopener noreferrer">' + label + "</a>");
    text = text.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>");
    text = text.replace(/__([^_]+)__/g, "<strong>$1</strong>");
    text = text.replace(/(^|[^*\w])\*([^*\s][^*]*)\*(?!\w)/g, "$1<em>$2</em>");
    text = text.replace(/(^|[^_\w])_([^_\s][^_]*)_(?!\w)/g, "$1<em>$2</em>");
    return text.replace(/\u0000(\d+)\u0000/g, (_, i) => spans[Number(i)]);
  }

  function render(source) {
    const lines = escapeHtml(String(source)).replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let para = [];
    let list = null; // {tag, items}
    let quote = [];
    const flushPara = () => {
      if (para.length) out.push("<p>" + para.map(inline).join("<br>") + "</p>");
      para = [];
    };
    const flushList = () => {
      if (list) out.push("<" + list.tag + ">" + list.items.map((i) => "<li>" + inline(i) + "</li>").join("") +
        "</" + list.tag + ">");
      list = null;
    };
    const flushQuote = () => {
      if (quote.length) out.push("<blockquote>" + render(unescapeHtml(quote.join("\n"))) + "</blockquote>");
      quote = [];
    };
    const flushAll = () => { flushPara(); flushList(); flushQuote(); };

    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*```\s*([\w+-]*)\s*$/);
      if (fence) { // a code block runs to its closing fence, or to the end while it streams
        flushAll();
        const code = [];
        for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
        const cls = fence[1] ? ' class="language-' + fence[1] + '"' : "";
        out.push("<pre><code" + cls + ">" + code.join("\n") + "</code></pre>");
        continue;
      }
      if (/^\s*$/.test(line)) { flushAll(); continue; }
      const quoted = line.match(/^\s*&gt;\s?(.*)$/);
      if (quoted) { flushPara(); flushList(); quote.push(quoted[1]); continue; }
      flushQuote();
      const heading = line.match(/^\s*(#{1,6})\s+(.*?)\s*#*\s*$/);
      if (heading) {
        flushAll();
        const n = heading[1].length;
        out.push("<h" + n + ">" + inline(heading[2]) + "</h" + n + ">");
        continue;
      }
      if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) { flushAll(); out.push("<hr>"); continue; }
      const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
      const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
      if (bullet || numbered) {
        flushPara();
        const tag = bullet ? "ul" : "ol";
        if (list && list.tag !== tag) flushList();
        if (!list) list = { tag, items: [] };
        list.items.push((bullet || numbered)[1]);
        continue;
      }
      if (list && /^\s{2,}\S/.test(line)) { // a list item's continuation line
        list.items[list.items.length - 1] += " " + line.trim();
        continue;
      }
      flushList();
      para.push(line);
    }
    flushAll();
    return out.join("\n");
  }

  // A quote's lines are rendered again as markdown of their own; they were escaped once already.
  const UNESC = { "&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"', "&#39;": "'" };
  const unescapeHtml = (s) => s.replace(/&(amp|lt|gt|quot|#39);/g, (e) => UNESC[e]);

  window.ferryMarkdown = { render, escapeHtml };
})();
