// The console's entry point: tabs, the keys and confirmation dialogs, and the connection
// watch (a gateway that is briefly gone is said so, and the page reconnects by itself).

import { keys } from "./api.js";
import { $ } from "./dom.js";
import { ChatView } from "./chat.js";
import { OpsView } from "./ops.js";

function confirmDialog(title, text, okLabel = "Confirm") {
  const dialog = $("confirm");
  $("confirm-title").textContent = title;
  $("confirm-text").textContent = text;
  $("confirm-ok").textContent = okLabel;
  return new Promise((resolve) => {
    const done = (answer) => {
      dialog.removeEventListener("close", onClose);
      $("confirm-ok").onclick = null;
      $("confirm-cancel").onclick = null;
      if (dialog.open) dialog.close();
      resolve(answer);
    };
    const onClose = () => done(false);
    $("confirm-ok").onclick = () => done(true);
    $("confirm-cancel").onclick = () => done(false);
    dialog.addEventListener("close", onClose);
    dialog.showModal();
    $("confirm-cancel").focus();
  });
}

function bindKeys(onChange) {
  const dialog = $("keys");
  $("open-keys").addEventListener("click", () => {
    $("api-key").value = keys.get("api");
    $("admin-key").value = keys.get("admin");
    $("remember-keys").checked = keys.isRemembered();
    dialog.showModal();
    $("api-key").focus();
  });
  $("keys-cancel").addEventListener("click", () => dialog.close());
  const save = () => {
    const remember = $("remember-keys").checked;
    keys.set("api", $("api-key").value.trim(), remember);
    keys.set("admin", $("admin-key").value.trim(), remember);
    dialog.close();
    $("open-keys").classList.remove("attention");
    onChange();
  };
  // A 401 anywhere: point at the Keys button.
  window.addEventListener("zeroserve:unauthorized", () => $("open-keys").classList.add("attention"));
  $("keys-save").addEventListener("click", save);
  for (const id of ["api-key", "admin-key"]) {
    $(id).addEventListener("keydown", (e) => { if (e.key === "Enter") save(); });
  }
}

function bindTabs(ops) {
  const show = (view) => {
    for (const tab of document.querySelectorAll(".tab")) {
      const active = tab.dataset.view === view;
      tab.classList.toggle("active", active);
      tab.setAttribute("aria-selected", String(active));
    }
    $("view-chat").hidden = view !== "chat";
    $("view-ops").hidden = view !== "ops";
    if (view === "ops") ops.tick();
    history.replaceState(null, "", view === "ops" ? "#ops" : "#chat");
  };
  for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => show(tab.dataset.view));
  show(location.hash === "#ops" ? "ops" : "chat");
}

// Ask /health/live (no key needed) every 2 s; say when the gateway is gone and when it is back.
function watchConnection(onReconnect) {
  const pill = $("conn");
  const banner = $("banner");
  let isUp = null;
  let downSince = 0;
  let hideTimer = null;
  const check = async () => {
    let ok = false;
    try {
      // A stalled gateway accepts the connection and says nothing: give up after 3 s.
      const response = await fetch("/health/live", {
        cache: "no-store", credentials: "omit", signal: AbortSignal.timeout(3000),
      });
      ok = response.ok;
    } catch {
      ok = false;
    }
    if (ok && isUp !== true) {
      pill.className = "pill pill-ok";
      pill.textContent = "connected";
      if (isUp === false) {
        banner.textContent = `Reconnected to the gateway after ${Math.round((Date.now() - downSince) / 1000)} s.`;
        banner.className = "banner good";
        banner.hidden = false;
        clearTimeout(hideTimer);
        hideTimer = setTimeout(() => { banner.hidden = true; }, 4000);
        onReconnect();
      }
      isUp = true;
    } else if (!ok) {
      if (isUp !== false) downSince = Date.now();
      isUp = false;
      clearTimeout(hideTimer);
      pill.className = "pill pill-bad";
      pill.textContent = "disconnected";
      banner.className = "banner";
      banner.textContent = `The gateway at ${location.host} does not answer (for ${Math.round((Date.now() - downSince) / 1000)} s). Reconnecting…`;
      banner.hidden = false;
    }
    setTimeout(check, isUp ? 2000 : 1000);
  };
  check();
}

const chat = new ChatView({ confirm: confirmDialog });
const ops = new OpsView({ confirm: confirmDialog });
bindKeys(() => {
  chat.loadModels();
  ops.keysChanged();
  ops.tick();
});
bindTabs(ops);
chat.loadModels();
ops.start();
watchConnection(() => {
  chat.loadModels();
  ops.tick();
});
