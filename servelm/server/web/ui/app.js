// servelm's chat page: talks to this server's OpenAI API (/v1/models, /v1/chat/completions, streamed), keeps
// conversations and settings in localStorage, and asks for an API key when the server answers 401.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  // the API sits beside this script's folder: at / or, behind a proxy's prefix (--root-path), under it
  const API = new URL("..", document.currentScript.src);
  const api = (path) => new URL(path, API).href;
  const STORE = "servelm.chats.v1", SETTINGS = "servelm.settings.v1", KEY = "servelm.apiKey";
  const ui = {
    model: $("model"), system: $("system"), temperature: $("temperature"), maxTokens: $("max-tokens"),
    messages: $("messages"), prompt: $("prompt"), send: $("send"), stop: $("stop"), status: $("status"),
    chats: $("chats"), keyForm: $("key-form"), apiKey: $("api-key"), keyError: $("key-error"),
    forgetKey: $("forget-key"),
  };

  function load(name, fallback) {
    try {
      return JSON.parse(localStorage.getItem(name)) ?? fallback;
    } catch (e) {
      return fallback;
    }
  }

  let db = load(STORE, null);
  if (!db || !Array.isArray(db.chats)) db = { current: null, chats: [] };
  let running = null; // {controller, message} while a reply streams
  let lastSaved = 0;

  const save = () => {
    localStorage.setItem(STORE, JSON.stringify(db));
    lastSaved = Date.now();
  };
  const current = () => db.chats.find((c) => c.id === db.current);
  const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);

  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = localStorage.getItem(KEY);
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function errorText(resp) {
    try {
      const body = await resp.json();
      return (body.error && (body.error.message || body.error)) || resp.statusText;
    } catch (e) {
      return resp.statusText || "HTTP " + resp.status;
    }
  }

  // -- API key ----------------------------------------------------------------------------------------------
  function askForKey(message) {
    ui.keyForm.hidden = false;
    ui.keyError.textContent = message || "";
    ui.apiKey.focus();
  }

  ui.keyForm.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    localStorage.setItem(KEY, ui.apiKey.value.trim());
    if (await loadModels()) {
      ui.keyForm.hidden = true;
      ui.apiKey.value = "";
    }
  });
  ui.forgetKey.addEventListener("click", () => {
    localStorage.removeItem(KEY);
    ui.forgetKey.hidden = true;
    loadModels();
  });

  // -- models and settings ----------------------------------------------------------------------------------
  async function loadModels() {
    let resp;
    try {
      resp = await fetch(api("v1/models"), { headers: headers() });
    } catch (e) {
      ui.status.textContent = "cannot reach the server: " + e.message;
      return false;
    }
    if (resp.status === 401) {
      askForKey(localStorage.getItem(KEY) ? "that key was refused: " + (await errorText(resp)) : "");
      return false;
    }
    if (!resp.ok) {
      ui.status.textContent = await errorText(resp);
      return false;
    }
    ui.forgetKey.hidden = !localStorage.getItem(KEY);
    const cards = (await resp.json()).data || [];
    const chat = cards.filter((c) => c.max_model_len); // embedding models have no context length
    const settings = load(SETTINGS, {});
    ui.model.replaceChildren(...(chat.length ? chat : cards).map((c) => new Option(c.id, c.id)));
    if (settings.model && [...ui.model.options].some((o) => o.value === settings.model)) {
      ui.model.value = settings.model;
    }
    ui.status.textContent = "";
    return true;
  }

  function loadSettings() {
    const s = load(SETTINGS, {});
    if (typeof s.system === "string") ui.system.value = s.system;
    if (s.temperature !== undefined) ui.temperature.value = s.temperature;
    if (s.maxTokens !== undefined) ui.maxTokens.value = s.maxTokens;
  }

  function saveSettings() {
    localStorage.setItem(SETTINGS, JSON.stringify({
      model: ui.model.value, system: ui.system.value, temperature: ui.temperature.value,
      maxTokens: ui.maxTokens.value,
    }));
  }
  for (const input of [ui.model, ui.system, ui.temperature, ui.maxTokens]) input.addEventListener("change", saveSettings);

  // -- rendering --------------------------------------------------------------------------------------------
  function statsText(m) {
    if (!m.stats) return m.state === "stopped" ? "stopped" : "";
    const s = m.stats, parts = [];
    if (s.ttftMs !== undefined) parts.push("TTFT " + Math.round(s.ttftMs) + " ms");
    if (s.tokensPerS !== undefined) parts.push(s.tokensPerS.toFixed(1) + " tokens/s");
    if (s.tokens !== undefined) parts.push((s.estimated ? "~" : "") + s.tokens + " tokens");
    if (m.state === "stopped") parts.push("stopped");
    return parts.join(" · ");
  }

  function renderMessage(m, node) {
    node = node || document.createElement("div");
    node.className = "msg " + m.role + (m.state === "error" ? " error" : "");
    node.dataset.state = m.state || "done";
    const role = document.createElement("div");
    role.className = "role";
    role.textContent = m.role === "user" ? "You" : (m.model || "assistant");
    const body = document.createElement("div");
    body.className = "body";
    if (m.role === "assistant" && m.state !== "error") window.servelmMarkdown.render(m.content, body);
    else body.textContent = m.content;
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = statsText(m);
    const parts = [role];
    if (m.reasoning) parts.push(renderThinking(m));
    node.replaceChildren(...parts, body, stats);
    return node;
  }

  // A reasoning model's thinking (the server's reasoning parser sends it as delta.reasoning): shown as text,
  // folded once the answer begins unless the reader opened it.
  function renderThinking(m) {
    const box = document.createElement("details");
    box.className = "thinking";
    box.open = m.thinkingOpen ?? (m.state === "streaming" && !m.content);
    const summary = document.createElement("summary");
    summary.textContent = m.state === "streaming" && !m.content ? "Thinking…" : "Thought";
    const text = document.createElement("div");
    text.textContent = m.reasoning;
    box.replaceChildren(summary, text);
    // the reader's choice, kept across redraws (a toggle event would also fire for the open set above)
    summary.addEventListener("click", () => {
      m.thinkingOpen = !box.open;
    });
    return box;
  }

  function renderChats() {
    ui.chats.replaceChildren(...db.chats.map((c) => {
      const li = document.createElement("li");
      li.textContent = c.title || "New chat";
      li.title = li.textContent;
      if (c.id === db.current) li.className = "current";
      li.addEventListener("click", () => {
        if (running) return;
        db.current = c.id;
        save();
        render();
      });
      return li;
    }));
  }

  function render() {
    renderChats();
    const chat = current();
    ui.messages.replaceChildren(...(chat ? chat.messages.map((m) => renderMessage(m)) : []));
    ui.messages.scrollTop = ui.messages.scrollHeight;
  }

  function newChat() {
    const chat = { id: newId(), title: "", messages: [] };
    db.chats.unshift(chat);
    db.current = chat.id;
    save();
    render();
    return chat;
  }

  // -- sending ----------------------------------------------------------------------------------------------
  function setRunning(r) {
    running = r;
    ui.send.disabled = !!r;
    ui.stop.hidden = !r;
  }

  async function send(text) {
    const chat = current() || newChat();
    if (!chat.title) chat.title = text.slice(0, 60);
    chat.messages.push({ role: "user", content: text });
    const history = chat.messages.map((m) => ({ role: m.role, content: m.content }));
    const reply = { role: "assistant", content: "", model: ui.model.value, state: "streaming" };
    chat.messages.push(reply);
    save();
    render();
    const node = ui.messages.lastElementChild;
    const controller = new AbortController();
    setRunning({ controller, reply });
    ui.status.textContent = "";

    const system = ui.system.value.trim();
    const body = {
      model: ui.model.value || undefined, stream: true, stream_options: { include_usage: true },
      messages: (system ? [{ role: "system", content: system }] : []).concat(history),
    };
    const temperature = parseFloat(ui.temperature.value), maxTokens = parseInt(ui.maxTokens.value, 10);
    if (!Number.isNaN(temperature)) body.temperature = temperature;
    if (!Number.isNaN(maxTokens)) body.max_tokens = maxTokens;

    const t0 = performance.now();
    let tFirst, tLast, chunks = 0, usage = null, pending = false;
    const redraw = () => {
      pending = false;
      renderMessage(reply, node);
      ui.messages.scrollTop = ui.messages.scrollHeight;
    };
    const finish = (state, error) => {
      reply.state = state;
      if (error) reply.content = reply.content ? reply.content + "\n\n" + error : error;
      if (tFirst !== undefined) {
        const tokens = usage ? usage.completion_tokens : chunks;
        const secs = ((tLast ?? tFirst) - tFirst) / 1000;
        reply.stats = { ttftMs: tFirst - t0, tokens, estimated: !usage };
        if (secs > 0 && tokens > 1) reply.stats.tokensPerS = (tokens - 1) / secs;
      }
      if (state === "error" && !reply.content) reply.content = "error";
      save();
      redraw();
    };

    try {
      const resp = await fetch(api("v1/chat/completions"), {
        method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
      });
      if (!resp.ok) {
        const msg = await errorText(resp);
        if (resp.status === 401) askForKey(msg);
        finish("error", msg);
        return;
      }
      const reader = resp.body.getReader(), decoder = new TextDecoder();
      let buf = "", done = false;
      while (!done) {
        const r = await reader.read();
        if (r.done) break;
        buf += decoder.decode(r.value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const event = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data:")) continue;
            const data = line.slice(5).trim();
            if (data === "[DONE]") {
              done = true;
              break;
            }
            const obj = JSON.parse(data);
            if (obj.error) throw new Error(obj.error.message || "the server reported an error");
            if (obj.usage) usage = obj.usage;
            const delta = obj.choices && obj.choices[0] && obj.choices[0].delta;
            const thought = delta && (delta.reasoning || delta.reasoning_content);
            if (delta && (delta.content || thought)) {
              const now = performance.now();
              if (tFirst === undefined) tFirst = now;
              tLast = now;
              chunks++;
              if (thought) reply.reasoning = (reply.reasoning || "") + thought;
              if (delta.content) reply.content += delta.content;
              if (Date.now() - lastSaved > 500) save();
              if (!pending) {
                pending = true;
                requestAnimationFrame(redraw);
              }
            }
          }
        }
      }
      finish("done");
    } catch (e) {
      if (e.name === "AbortError") finish("stopped");
      else finish("error", e.message);
    } finally {
      setRunning(null);
    }
  }

  ui.stop.addEventListener("click", () => running && running.controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (!running) newChat();
  });
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = ui.prompt.value.trim();
    if (!text || running) return;
    ui.prompt.value = "";
    send(text);
  });
  ui.prompt.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });

  // A reply that was streaming when the page went away stays as far as it got.
  for (const c of db.chats) for (const m of c.messages) if (m.state === "streaming") m.state = "stopped";
  loadSettings();
  render();
  loadModels();
})();
