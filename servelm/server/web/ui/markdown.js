// A small Markdown renderer that builds DOM nodes: model text only ever becomes text nodes (never HTML), so a
// reply holding <script> or <img onerror=...> shows those characters and runs nothing. It covers what chat
// replies use: fenced code blocks, headings, lists, quotes, paragraphs, inline code, bold, italics and links
// (http, https and mailto only). An unterminated fence (a reply still streaming) runs to the end.
"use strict";

(function () {
  function el(tag, cls) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    return e;
  }

  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*]+)\*\*|__([^_]+)__|\*([^*\s][^*]*)\*|_([^_\s][^_]*)_|\[([^\]]+)\]\(([^)\s]+)\)/g;
  const SAFE_URL = /^(https?:\/\/|mailto:)/i;

  function inline(text, parent) {
    let last = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
      let node;
      if (m[1]) {
        node = el("code");
        node.textContent = m[2];
      } else if (m[3] !== undefined || m[4] !== undefined) {
        node = el("strong");
        inline(m[3] ?? m[4], node);
      } else if (m[5] !== undefined || m[6] !== undefined) {
        node = el("em");
        inline(m[5] ?? m[6], node);
      } else if (SAFE_URL.test(m[8])) {
        node = el("a");
        node.href = m[8];
        node.rel = "noopener noreferrer nofollow";
        node.target = "_blank";
        inline(m[7], node);
      } else {
        node = document.createTextNode(m[0]); // javascript:, data: and the like stay plain text
      }
      parent.appendChild(node);
      last = m.index + m[0].length;
    }
    if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
  }

  function lines(texts, parent) {
    texts.forEach((t, i) => {
      if (i) parent.appendChild(el("br"));
      inline(t, parent);
    });
  }

  const FENCE = /^\s*(```|~~~)\s*([\w+.#-]*)\s*$/;
  const HEADING = /^(#{1,6})\s+(.*)$/;
  const BULLET = /^\s*[-*+]\s+(.*)$/;
  const NUMBERED = /^\s*\d+[.)]\s+(.*)$/;
  const QUOTE = /^\s*>\s?(.*)$/;

  // Render `text` as Markdown into `container` (its children are replaced).
  function render(text, container) {
    container.replaceChildren();
    const src = String(text).replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    while (i < src.length) {
      const line = src[i];
      const fence = line.match(FENCE);
      if (fence) {
        const code = [];
        i++;
        while (i < src.length && !(src[i].trim().startsWith(fence[1]) && FENCE.test(src[i]))) code.push(src[i++]);
        i++; // the closing fence
        const pre = el("pre");
        const c = el("code");
        if (fence[2]) c.dataset.lang = fence[2];
        c.textContent = code.join("\n");
        pre.appendChild(c);
        container.appendChild(pre);
        continue;
      }
      if (!line.trim()) {
        i++;
        continue;
      }
      const h = line.match(HEADING);
      if (h) {
        const node = el("h" + Math.min(6, h[1].length + 2)); // h3..h6: a reply's headings stay small
        inline(h[2], node);
        container.appendChild(node);
        i++;
        continue;
      }
      let listed = false;
      for (const [re, tag] of [[BULLET, "ul"], [NUMBERED, "ol"]]) {
        if (!re.test(line)) continue;
        const list = el(tag);
        while (i < src.length && re.test(src[i])) {
          const li = el("li");
          inline(src[i].match(re)[1], li);
          list.appendChild(li);
          i++;
        }
        container.appendChild(list);
        listed = true;
        break;
      }
      if (listed) continue;
      if (QUOTE.test(line)) {
        const q = el("blockquote");
        const body = [];
        while (i < src.length && QUOTE.test(src[i])) body.push(src[i++].match(QUOTE)[1]);
        lines(body, q);
        container.appendChild(q);
        continue;
      }
      const para = [];
      while (i < src.length && src[i].trim() && !FENCE.test(src[i]) && !HEADING.test(src[i]) &&
             !(para.length && (BULLET.test(src[i]) || NUMBERED.test(src[i]) || QUOTE.test(src[i])))) {
        para.push(src[i++]);
      }
      const p = el("p");
      lines(para, p);
      container.appendChild(p);
    }
  }

  window.servelmMarkdown = { render };
})();
