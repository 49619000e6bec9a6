// ferry serve's chat playground: one conversation against this server's /v1/chat/completions,
// streamed, with its sampling settings, and each answer's time to first token and decode speed.
// The conversation lives in this page only; settings and the API key stay in localStorage.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const state = { history: [], controller: null, busy: false };
  window.ferryPlayground = state; // for a look from the console (and the browser tests)

  const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "seed", "api-key"];
  for (const id of SETTINGS) {
    const saved = localStorage.getItem("ferry." + id);
    if (saved !== null) $(id).value = saved;
    $(id).addEventListener("change", () => localStorage.setItem("ferry." + id, $(id).value));
  }
  for (const id of ["temperature", "top_p"]) {
    const show = () => { $(id + "-value").textContent = $(id).value; };
    $(id).addEventListener("input", show);
    show();
  }

  function headers() {
    const h = { "content-type": "application/json" };
    const key = $("api-key").value.trim();
    if (key) h.authorization = "Bearer " + key;
    return h;
  }

  function showError(text) {
    $("error").textContent = text;
    $("error").hidden = !text;
  }

  async function errorText(resp) {
    try {
      const body = await resp.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (_) { /* not JSON */ }
    return "HTTP " + resp.status;
  }

  async function loadModels() {
    const badge = $("server-status");
    try {
      const resp = await fetch("v1/models", { headers: headers() });
      if (!resp.ok) throw new Error(await errorText(resp));
      const body = await resp.json();
      const select = $("model");
      select.replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
      badge.textContent = "ready";
      badge.className = "badge ok";
      showError("");
    } catch (e) {
      badge.textContent = "not connected";
      badge.className = "badge bad";
      showError("Could not list the models: " + e.message + (/key/i.test(e.message) ? " (set the API key)" : ""));
    }
  }
  $("api-key").addEventListener("change", loadModels);

  function addMessage(role, text) {
    const div = document.createElement("div");
    div.className = "message " + role;
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role;
    div.append(label);
    const body = document.createElement("div");
    body.className = "content";
    if (role === "user") body.textContent = text; // the user's own words, shown as typed
    div.append(body);
    $("messages").append(div);
    div.scrollIntoView({ block: "end" });
    return div;
  }

  function setBusy(busy) {
    state.busy = busy;
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    $("prompt").disabled = busy;
  }

  // One streamed answer: read the server-sent events as they come, render the text so far.
  async function send(prompt) {
    showError("");
    const model = $("model").value;
    if (!model) { await loadModels(); if (!$("model").value) return; }
    state.history.push({ role: "user", content: prompt });
    const asked = addMessage("user", prompt);
    const div = addMessage("assistant", "");
    const content = div.querySelector(".content");
    const stats = document.createElement("div");
    stats.className = "stats";
    div.append(stats);

    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...state.history);
    const body = {
      model: $("model").value, messages, stream: true, stream_options: { include_usage: true },
      temperature: Number($("temperature").value), top_p: Number($("top_p").value),
      max_tokens: Number($("max_tokens").value) || 256,
    };
    if ($("seed").value !== "") body.seed = Number($("seed").value);

    const answer = { text: "", reasoning: "", finish: null, tokens: null, error: null };
    const sent = performance.now();
    let first = null, last = null, chunks = 0, pending = false;
    const draw = () => {
      pending = false;
      content.innerHTML = window.ferryMarkdown.render(answer.text);
      if (answer.reasoning) {
        let r = div.querySelector(".reasoning");
        if (!r) { r = document.createElement("div"); r.className = "reasoning"; div.insertBefore(r, content); }
        r.textContent = answer.reasoning;
      }
      const parts = [];
      if (first !== null) parts.push("TTFT " + Math.round(first - sent) + " ms");
      const n = answer.tokens ?? chunks;
      if (first !== null && last > first && n > 1) parts.push(((n - 1) / ((last - first) / 1000)).toFixed(1) + " tok/s");
      if (answer.tokens !== null) parts.push(answer.tokens + " tokens");
      if (answer.finish) parts.push("finish: " + answer.finish);
      stats.textContent = parts.join(" · ");
      div.scrollIntoView({ block: "end" });
    };
    const redraw = () => { if (!pending) { pending = true; requestAnimationFrame(draw); } };

    const onEvent = (data) => {
      if (data === "[DONE]") return;
      const event = JSON.parse(data);
      if (event.error) { answer.error = event.error.message || String(event.error); return; }
      if (event.usage) answer.tokens = event.usage.completion_tokens;
      for (const choice of event.choices || []) {
        const delta = choice.delta || {};
        if (delta.content || delta.reasoning_content) {
          if (first === null) first = performance.now();
          last = performance.now();
          chunks += 1;
          answer.text += delta.content || "";
          answer.reasoning += delta.reasoning_content || "";
        }
        if (choice.finish_reason) answer.finish = choice.finish_reason;
      }
      redraw();
    };

    state.controller = new AbortController();
    setBusy(true);
    try {
      const resp = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.controller.signal,
      });
      if (!resp.ok) throw new Error(await errorText(resp));
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          for (const line of event.split("\n")) if (line.startsWith("data:")) onEvent(line.slice(5).trim());
        }
      }
    } catch (e) {
      answer.error = e.name === "AbortError" ? null : e.message;
      if (e.name === "AbortError") answer.finish = "stopped";
    } finally {
      setBusy(false);
      state.controller = null;
    }
    draw();
    if (answer.error) showError(answer.error);
    if (answer.text || answer.reasoning) {
      state.history.push({ role: "assistant", content: answer.text });
      div.dataset.done = "true";
    } else { // nothing came back: the question goes back into the box, to be asked again
      state.history.pop();
      asked.remove();
      div.remove();
      if (!$("prompt").value) $("prompt").value = prompt;
    }
    $("prompt").focus();
  }

  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const prompt = $("prompt").value.trim();
    if (!prompt || state.busy) return;
    $("prompt").value = "";
    send(prompt);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  $("clear").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.history.length = 0;
    $("messages").replaceChildren();
    showError("");
  });

  loadModels();
})();
