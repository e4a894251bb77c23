// The chat view: conversations kept in localStorage, replies streamed from
// /v1/chat/completions with their timing and token counts. Text is always set with
// textContent, never parsed as HTML.

import { ApiError, call, getJson, sseData } from "./api.js";
import { $, el } from "./dom.js";

const STORE = "zeroserve.conversations";
const SETTINGS = "zeroserve.chatSettings";
const DEFAULT_SETTINGS = { model: "", temperature: 0.7, maxTokens: 512, system: "", schema: "" };

function newId() {
  return `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
}

export class ChatView {
  constructor({ confirm }) {
    this.confirm = confirm;
    this.conversations = this.load();
    this.settings = { ...DEFAULT_SETTINGS, ...this.loadJson(SETTINGS, {}) };
    this.currentId = this.conversations[0]?.id || null;
    this.controller = null; // AbortController of the reply streaming now
    this.emptyNode = $("empty-chat");
    this.bindSettings();
    this.bindActions();
    this.renderList();
    this.renderMessages();
  }

  // --- storage ----------------------------------------------------------------------------

  loadJson(name, fallback) {
    try {
      return JSON.parse(localStorage.getItem(name)) ?? fallback;
    } catch {
      return fallback;
    }
  }

  load() {
    const list = this.loadJson(STORE, []);
    return Array.isArray(list) ? list.filter((c) => c && Array.isArray(c.messages)) : [];
  }

  save() {
    try {
      localStorage.setItem(STORE, JSON.stringify(this.conversations));
    } catch {
      this.showError("The browser's storage is full: this conversation is not saved. Export and delete old ones.");
    }
  }

  get current() {
    return this.conversations.find((c) => c.id === this.currentId) || null;
  }

  ensureConversation() {
    if (!this.current) {
      const conversation = { id: newId(), title: "New chat", created: new Date().toISOString(), messages: [] };
      this.conversations.unshift(conversation);
      this.currentId = conversation.id;
    }
    return this.current;
  }

  // --- settings ---------------------------------------------------------------------------

  bindSettings() {
    const s = this.settings;
    $("temperature").value = s.temperature;
    $("temperature-value").textContent = Number(s.temperature).toFixed(2);
    $("max-tokens").value = s.maxTokens;
    $("system-prompt").value = s.system;
    $("json-schema").value = s.schema;
    const store = () => localStorage.setItem(SETTINGS, JSON.stringify(this.settings));
    $("temperature").addEventListener("input", (e) => {
      s.temperature = Number(e.target.value);
      $("temperature-value").textContent = s.temperature.toFixed(2);
      store();
    });
    $("max-tokens").addEventListener("input", (e) => { s.maxTokens = Number(e.target.value); store(); });
    $("system-prompt").addEventListener("input", (e) => { s.system = e.target.value; store(); });
    $("json-schema").addEventListener("input", (e) => {
      s.schema = e.target.value;
      this.checkSchema();
      store();
    });
    $("model").addEventListener("change", (e) => { s.model = e.target.value; store(); });
    this.checkSchema();
  }

  // The schema as an object, null when the field is empty; throws when it is not JSON.
  parsedSchema() {
    const text = this.settings.schema.trim();
    if (!text) return null;
    const schema = JSON.parse(text);
    if (typeof schema !== "object" || schema === null || Array.isArray(schema)) {
      throw new Error("a JSON schema is an object");
    }
    return schema;
  }

  checkSchema() {
    const note = $("schema-note");
    try {
      const schema = this.parsedSchema();
      note.textContent = schema ? "Replies are constrained to this schema." : "";
      note.classList.remove("bad");
    } catch (err) {
      note.textContent = `Not valid JSON: ${err.message}`;
      note.classList.add("bad");
    }
  }

  async loadModels() {
    const select = $("model");
    const note = $("model-note");
    try {
      const models = (await getJson("/v1/models")).data || [];
      select.replaceChildren(...models.map((m) => el("option", "", m.id)));
      const ids = models.map((m) => m.id);
      if (!ids.includes(this.settings.model)) this.settings.model = ids[0] || "";
      select.value = this.settings.model;
      const chosen = models.find((m) => m.id === this.settings.model);
      note.textContent = chosen?.max_model_len ? `Context: ${chosen.max_model_len} tokens` : "";
      note.classList.remove("bad");
    } catch (err) {
      if (err instanceof ApiError && err.status === 0) return; // the connection banner says it
      note.textContent = err.message;
      note.classList.add("bad");
    }
  }

  // --- actions ----------------------------------------------------------------------------

  bindActions() {
    $("send").addEventListener("click", () => this.sendFromComposer());
    $("stop").addEventListener("click", () => this.stop());
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        this.sendFromComposer();
      }
    });
    $("new-chat").addEventListener("click", () => {
      if (this.controller) return;
      this.currentId = null;
      this.renderList();
      this.renderMessages();
      $("prompt").focus();
    });
    $("delete-chat").addEventListener("click", async () => {
      if (this.controller || !this.current) return;
      const title = this.current.title || "this chat";
      if (!(await this.confirm("Delete this chat?", `"${title}" is removed from this browser. Export first to keep a copy.`, "Delete"))) return;
      this.conversations = this.conversations.filter((c) => c.id !== this.currentId);
      this.currentId = this.conversations[0]?.id || null;
      this.save();
      this.renderList();
      this.renderMessages();
    });
    $("export-chats").addEventListener("click", () => this.exportAll());
  }

  exportAll() {
    const body = JSON.stringify({ exported: new Date().toISOString(), conversations: this.conversations }, null, 2);
    const url = URL.createObjectURL(new Blob([body], { type: "application/json" }));
    const link = el("a");
    link.href = url;
    link.download = `zeroserve-chats-${new Date().toISOString().slice(0, 10)}.json`;
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  }

  sendFromComposer() {
    const text = $("prompt").value.trim();
    if (!text || this.controller) return;
    try {
      this.parsedSchema();
    } catch (err) {
      this.showError(`The JSON schema is not valid JSON: ${err.message}`); // the question stays
      return;
    }
    const conversation = this.ensureConversation();
    conversation.messages.push({ role: "user", content: text });
    if (conversation.title === "New chat") conversation.title = text.slice(0, 48);
    $("prompt").value = "";
    this.save();
    this.renderList();
    this.generate();
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  regenerate() {
    const messages = this.current?.messages;
    if (!messages || this.controller) return;
    if (messages.at(-1)?.role === "assistant") messages.pop();
    this.generate();
  }

  retry() {
    if (!this.controller && this.current?.messages.at(-1)?.role === "user") this.generate();
  }

  // Replace message `index` (a user turn) and drop everything after it, then ask again.
  editAndResend(index, text) {
    const conversation = this.current;
    if (!conversation || this.controller || !text.trim()) return;
    conversation.messages.splice(index);
    conversation.messages.push({ role: "user", content: text.trim() });
    if (index === 0) conversation.title = text.trim().slice(0, 48);
    this.save();
    this.renderList();
    this.generate();
  }

  requestBody(history) {
    const s = this.settings;
    const messages = history.map((m) => ({ role: m.role, content: m.content }));
    if (s.system.trim()) messages.unshift({ role: "system", content: s.system });
    const body = {
      model: s.model || undefined, messages, stream: true,
      stream_options: { include_usage: true }, temperature: s.temperature,
    };
    if (s.maxTokens > 0) body.max_tokens = Math.floor(s.maxTokens);
    const schema = this.parsedSchema();
    if (schema) {
      body.response_format = { type: "json_schema", json_schema: { name: "console", schema, strict: true } };
    }
    return body;
  }

  async generate() {
    const conversation = this.current;
    this.hideError();
    let body;
    try {
      body = this.requestBody(conversation.messages);
    } catch (err) {
      this.showError(`The JSON schema is not valid JSON: ${err.message}`);
      this.renderMessages();
      return;
    }
    const reply = { role: "assistant", content: "", reasoning: "", stats: { model: body.model, json: !!body.response_format } };
    conversation.messages.push(reply);
    const controller = (this.controller = new AbortController()); // set first: no actions drawn
    this.renderMessages();
    const view = this.messageViews.at(-1);
    view.root.classList.add("streaming");
    this.setBusy(true);
    const started = performance.now();
    let firstAt = null;
    let numChunks = 0;
    try {
      const response = await call("/v1/chat/completions", { method: "POST", body, signal: controller.signal });
      for await (const data of sseData(response)) {
        let chunk;
        try {
          chunk = JSON.parse(data);
        } catch {
          throw new ApiError(0, "The server sent an event that is not JSON; the reply stops here.");
        }
        if (chunk.error) throw new ApiError(500, `The server ended the reply: ${chunk.error.message}`);
        const delta = chunk.choices?.[0]?.delta || {};
        const reasoning = delta.reasoning_content ?? delta.reasoning;
        if (delta.content || reasoning) {
          if (firstAt === null) firstAt = performance.now();
          numChunks += 1;
          if (reasoning) reply.reasoning += reasoning;
          if (delta.content) reply.content += delta.content;
          this.updateText(view, reply);
        }
        if (chunk.choices?.[0]?.finish_reason) reply.stats.finish = chunk.choices[0].finish_reason;
        if (chunk.usage) reply.stats.usage = chunk.usage;
        if (chunk.model) reply.stats.model = chunk.model;
      }
      if (!reply.stats.finish) {
        throw new ApiError(0, "The reply ended without a finish reason: the connection was cut.");
      }
    } catch (err) {
      if (err.name === "AbortError") {
        reply.stats.finish = "stopped";
      } else {
        // A TypeError from the body's reader: the connection broke mid-reply.
        reply.error = err instanceof ApiError ? err.message
          : `The connection to the gateway broke during the reply (${err.message}).`;
        reply.stats.finish = reply.stats.finish || "error";
        this.showError(reply.error);
      }
    } finally {
      this.finishStats(reply, started, firstAt, performance.now(), numChunks);
      // Nothing came (refused, or stopped before the first token): no empty reply is kept.
      if (!reply.content && !reply.reasoning && (reply.error || reply.stats.finish === "stopped")) {
        conversation.messages.pop();
      }
      this.controller = null;
      this.setBusy(false);
      this.save();
      this.renderMessages();
    }
  }

  finishStats(reply, started, firstAt, endedAt, numChunks) {
    const stats = reply.stats;
    if (firstAt !== null) stats.ttftMs = Math.round(firstAt - started);
    const usage = stats.usage || {};
    stats.completionTokens = usage.completion_tokens ?? numChunks;
    stats.promptTokens = usage.prompt_tokens ?? null;
    stats.cachedTokens = usage.prompt_tokens_details?.cached_tokens ?? (usage.prompt_tokens != null ? 0 : null);
    // Decode speed: the tokens after the first over the time after the first.
    const decodeS = firstAt === null ? 0 : (endedAt - firstAt) / 1000;
    if (stats.completionTokens > 1 && decodeS > 0) {
      stats.tokensPerS = Math.round(((stats.completionTokens - 1) / decodeS) * 10) / 10;
    }
    if (stats.json && reply.content) {
      try {
        JSON.parse(reply.content);
        stats.jsonValid = true;
      } catch {
        stats.jsonValid = false;
      }
    }
    delete stats.usage;
  }

  setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
  }

  showError(message) {
    const box = $("chat-error");
    box.textContent = message;
    box.hidden = false;
  }

  hideError() {
    $("chat-error").hidden = true;
  }

  // --- rendering --------------------------------------------------------------------------

  renderList() {
    const list = $("conversations");
    list.replaceChildren(...this.conversations.map((c) => {
      const item = el("li", c.id === this.currentId ? "active" : "", c.title || "Untitled");
      item.title = c.title || "";
      item.addEventListener("click", () => {
        if (this.controller) return;
        this.currentId = c.id;
        this.hideError();
        this.renderList();
        this.renderMessages();
      });
      return item;
    }));
  }

  renderMessages() {
    const box = $("messages");
    const messages = this.current?.messages || [];
    this.messageViews = messages.map((m, i) => this.messageView(m, i, i === messages.length - 1));
    box.replaceChildren(...(messages.length ? this.messageViews.map((v) => v.root) : [this.emptyNode]));
    box.scrollTop = box.scrollHeight;
  }

  messageView(message, index, isLast) {
    const root = el("div", `msg ${message.role}`);
    root.dataset.index = index;
    root.append(el("div", "role", message.role === "user" ? "You" : (message.stats?.model || "Assistant")));
    const reasoning = el("details", "reasoning");
    reasoning.open = true;
    reasoning.append(el("summary", "", "Reasoning"), el("div", "reasoning-text"));
    reasoning.hidden = true;
    const bubble = el("div", "bubble");
    root.append(reasoning, bubble);
    const view = { root, bubble, reasoning, reasoningText: reasoning.lastChild };
    this.updateText(view, message);
    if (message.role === "assistant") {
      if (message.stats && message.stats.ttftMs !== undefined) root.append(this.statsLine(message.stats));
      if (message.error) root.append(el("div", "error-text", message.error));
      if (isLast && !this.controller) root.append(this.actions([["Regenerate", () => this.regenerate()]]));
    } else {
      const actions = [["Edit", () => this.startEdit(view, index, message)]];
      // A question whose reply failed (a 429, a 503): ask it again as it stands.
      if (isLast && !this.controller) actions.push(["Retry", () => this.retry()]);
      root.append(this.actions(actions));
    }
    return view;
  }

  actions(entries) {
    const row = el("div", "msg-actions");
    for (const [label, handler] of entries) {
      const button = el("button", "", label);
      button.addEventListener("click", handler);
      row.append(button);
    }
    return row;
  }

  updateText(view, message) {
    const box = $("messages");
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    view.bubble.textContent = message.content;
    view.bubble.hidden = !message.content && !!message.reasoning;
    view.bubble.classList.toggle("json", !!message.stats?.json);
    if (message.reasoning) {
      view.reasoning.hidden = false;
      view.reasoningText.textContent = message.reasoning;
    }
    if (atBottom) box.scrollTop = box.scrollHeight;
  }

  statsLine(stats) {
    const line = el("div", "stats");
    const add = (name, label, value) => {
      const item = el("span");
      item.dataset.stat = name;
      item.append(`${label} `, el("b", "", value));
      line.append(item);
    };
    if (stats.ttftMs !== undefined) add("ttft", "TTFT", `${stats.ttftMs} ms`);
    if (stats.tokensPerS !== undefined) add("speed", "speed", `${stats.tokensPerS} tok/s`);
    add("completion", "tokens", String(stats.completionTokens ?? "?"));
    if (stats.promptTokens !== null && stats.promptTokens !== undefined) add("prompt", "prompt", String(stats.promptTokens));
    if (stats.cachedTokens !== null && stats.cachedTokens !== undefined) add("cached", "cached", String(stats.cachedTokens));
    if (stats.finish) add("finish", "finish", stats.finish);
    if (stats.jsonValid !== undefined) {
      const json = el("span", stats.jsonValid ? "good" : "bad", stats.jsonValid ? "valid JSON" : "not valid JSON");
      json.dataset.stat = "json";
      line.append(json);
    }
    return line;
  }

  startEdit(view, index, message) {
    if (this.controller) return;
    const box = el("div", "edit-box");
    const text = el("textarea");
    text.rows = 3;
    text.value = message.content;
    const row = el("div", "row");
    const cancel = el("button", "btn btn-ghost btn-small", "Cancel");
    const save = el("button", "btn btn-primary btn-small", "Save and send");
    row.append(cancel, save);
    box.append(text, row);
    view.bubble.replaceWith(box);
    view.root.querySelector(".msg-actions").hidden = true;
    cancel.addEventListener("click", () => this.renderMessages());
    save.addEventListener("click", () => this.editAndResend(index, text.value));
    text.focus();
  }
}
