// What both pages share: the API key (sessionStorage, sent as the bearer header) and the
// server's error messages in OpenAI's shape.

const KEY = "pagedllm.apiKey";

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: "Bearer " + key } : extra;
}

export function apiFetch(path, options = {}) {
  return fetch(path, { ...options, headers: headers(options.headers || {}) });
}

// The message of an error response: {"error": {"message": ...}}, else the status line.
export async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON */ }
  return `HTTP ${response.status} ${response.statusText}`.trim();
}

// The key form (#key-panel): shown when the server answers 401; `onKey` runs after a save.
export function keyPanel(onKey) {
  const panel = document.getElementById("key-panel");
  const input = document.getElementById("key-input");
  const error = document.getElementById("key-error");
  document.getElementById("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, input.value.trim());
    error.textContent = "";
    onKey();
  });
  return {
    ask(message) {
      panel.hidden = false;
      error.textContent = apiKey() ? message : "This server needs an API key. " + message;
      input.focus();
    },
    hide() {
      panel.hidden = true;
      error.textContent = "";
    },
  };
}
