// The chat page: a conversation sent to the server's own OpenAI endpoint (/v1/chat/completions, streamed), with
// a stop button (the request is aborted, which cancels the sequence on the server), a system prompt, sampling
// settings, reasoning shown folded, and images attached as data: URLs (image_url parts) when the model takes them.
// No build step: plain browser JavaScript.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, history: [], controller: null, images: [] };
const SETTINGS = ["system", "temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "api_key"];

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function saveSettings() {
  for (const id of SETTINGS) localStorage.setItem("hi-" + id, $(id).value);
}

function loadSettings() {
  for (const id of SETTINGS) {
    const v = localStorage.getItem("hi-" + id);
    if (v !== null) $(id).value = v;
  }
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    state.model = body.data[0].id;
    $("model").textContent = state.model;
    $("attach").hidden = !takesImages(body.data[0]);
  } catch (e) {
    $("model").textContent = "(models: " + e.message + ")";
  }
}

// Whether a /v1/models entry says the model takes images (llama-server's "modalities" / "capabilities" words).
function takesImages(m) {
  const words = [].concat(m.capabilities || [], (m.modalities && m.modalities.input) || m.modalities || []);
  return words.some((w) => w === "vision" || w === "image" || w === "multimodal");
}

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(r.result);
    r.onerror = () => reject(r.error);
    r.readAsDataURL(file);
  });
}

async function attach(files) {
  for (const f of files) state.images.push(await readAsDataURL(f));
  showAttached();
}

function showAttached() {
  $("attached").replaceChildren(...state.images.map((url) => Object.assign(document.createElement("img"), { src: url })));
}

// Reasoning the server did not split off (a template without <think> handling) is split here: text inside
// <think>...</think> is reasoning, the rest is the answer.
function splitThink(text) {
  let reasoning = "", answer = "", rest = text;
  while (rest.length) {
    const open = rest.indexOf("<think>");
    if (open < 0) { answer += rest; break; }
    answer += rest.slice(0, open);
    const close = rest.indexOf("</think>", open);
    if (close < 0) { reasoning += rest.slice(open + 7); break; }
    reasoning += rest.slice(open + 7, close);
    rest = rest.slice(close + 8);
  }
  return { reasoning, answer: answer.replace(/^\s+/, "") };
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  if (role === "assistant") {
    const det = document.createElement("details");
    det.className = "reasoning";
    det.hidden = true;
    const sum = document.createElement("summary");
    sum.textContent = "Reasoning";
    const body = document.createElement("div");
    body.className = "reasoning-text";
    det.append(sum, body);
    const content = document.createElement("div");
    content.className = "content";
    div.append(det, content);
    div.dataset.chunks = "0";
  } else {
    div.textContent = text;
  }
  $("log").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function show(div, reasoning, content) {
  const split = splitThink(content);
  const thought = reasoning + split.reasoning;
  const det = div.querySelector("details.reasoning");
  det.hidden = !thought;
  det.querySelector(".reasoning-text").textContent = thought;
  div.querySelector(".content").textContent = split.answer;
  div.scrollIntoView({ block: "end" });
}

function note(div, text) {
  const n = document.createElement("div");
  n.className = "note";
  n.textContent = text;
  div.append(n);
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("input").disabled = on;
  document.body.dataset.busy = on ? "1" : "0";
}

function body(messages) {
  const b = { model: state.model, messages, stream: true };
  for (const id of ["temperature", "top_p", "min_p"]) if ($(id).value !== "") b[id] = parseFloat($(id).value);
  for (const id of ["top_k", "max_tokens", "seed"]) if ($(id).value !== "") b[id] = parseInt($(id).value, 10);
  return b;
}

// Server-sent events from a fetch body: "data: {...}" lines, blank-line separated; "[DONE]" ends the stream.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.search(/\r?\n\r?\n/)) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function send(text) {
  const system = $("system").value.trim();
  const images = state.images.splice(0);
  showAttached();
  const content = images.length
    ? [{ type: "text", text }].concat(images.map((url) => ({ type: "image_url", image_url: { url } })))
    : text;
  state.history.push({ role: "user", content });
  const shown = addMessage("user", text);
  for (const url of images) shown.append(Object.assign(document.createElement("img"), { src: url }));
  const div = addMessage("assistant", "");
  const messages = (system ? [{ role: "system", content: system }] : []).concat(state.history);
  let reasoning = "", answer = "", finish = null;
  state.controller = new AbortController();
  busy(true);
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body(messages)), signal: state.controller.signal,
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error(err.error ? err.error.message : r.status + " " + r.statusText);
    }
    for await (const ev of events(r)) {
      if (ev.error) throw new Error(ev.error.message);
      const choice = ev.choices && ev.choices[0];
      if (!choice) continue;
      const d = choice.delta || {};
      if (d.reasoning_content) reasoning += d.reasoning_content;
      if (d.content) answer += d.content;
      if (d.tool_calls) answer += d.tool_calls.map((c) => "[tool call " + c.function.name + "]").join("");
      if (choice.finish_reason) finish = choice.finish_reason;
      div.dataset.chunks = String(Number(div.dataset.chunks) + 1);
      show(div, reasoning, answer);
    }
    div.dataset.finish = finish || "stop";
    if (finish === "length") note(div, "(cut at max tokens)");
  } catch (e) {
    if (e.name === "AbortError") {
      div.dataset.finish = "stopped";
      note(div, "(stopped)");
    } else {
      div.classList.add("error");
      div.dataset.finish = "error";
      note(div, "Error: " + e.message);
    }
  } finally {
    state.history.push({ role: "assistant", content: splitThink(answer).answer });
    state.controller = null;
    busy(false);
    $("input").focus();
  }
}

function init() {
  loadSettings();
  for (const id of SETTINGS) $(id).addEventListener("change", saveSettings);
  $("toggle-settings").addEventListener("click", () => {
    const s = $("settings");
    s.hidden = !s.hidden;
    $("toggle-settings").setAttribute("aria-expanded", String(!s.hidden));
  });
  $("new").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.history = [];
    state.images = [];
    showAttached();
    $("log").replaceChildren();
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    if (!text || state.controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("image").addEventListener("change", (e) => attach(Array.from(e.target.files)).finally(() => (e.target.value = "")));
  $("api_key").addEventListener("change", loadModel);
  busy(false);
  loadModel();
}

window.hybridinferChat = { splitThink, addMessage, show, takesImages, state };  // for tests and the console
init();
