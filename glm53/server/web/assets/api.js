// The server's API as the page calls it: the API key (this tab's sessionStorage only), JSON requests, and the
// SSE stream of /v1/chat/completions, read from fetch (EventSource can neither POST nor send the key).

const KEY_ITEM = "glm53.apiKey";

export const auth = {
  // the server says in the page whether it wants a key (never which)
  required: document.querySelector('meta[name="glm53-api-key"]').content === "required",
  get key() {
    return sessionStorage.getItem(KEY_ITEM) || "";
  },
  set key(value) {
    if (value) sessionStorage.setItem(KEY_ITEM, value);
    else sessionStorage.removeItem(KEY_ITEM);
  },
};

// An answer that is not a success, with the API's own message ({"error": {"message", ...}}) when it sent one.
export class APIError extends Error {
  constructor(status, body) {
    super(body?.error?.message || (status ? `HTTP ${status}` : "the server did not answer"));
    this.status = status;
    this.code = body?.error?.code ?? null;
  }
}

function headers(extra = {}, key = auth.key) {
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function send(path, init) {
  let response;
  try {
    response = await fetch(path, { cache: "no-store", ...init });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new APIError(0, null);
  }
  return response;
}

// GET a JSON answer; a non-2xx answer raises APIError with the API's message.
export async function getJSON(path, key) {
  const response = await send(path, { headers: headers({}, key) });
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new APIError(response.status, body);
  return body;
}

// /health answers 503 while the model loads, with the load's progress: both are answers here.
export async function health() {
  const response = await send("/health", {});
  return response.json().catch(() => ({ status: "unknown" }));
}

// The chunks of a streamed chat completion. An error frame from the server raises APIError; `signal` aborts the
// request, which closes the connection: the server then cancels the job and frees its slot.
export async function* streamChat(body, signal) {
  const response = await send("/v1/chat/completions", {
    method: "POST",
    headers: headers({ "Content-Type": "application/json" }),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!response.ok) throw new APIError(response.status, await response.json().catch(() => null));
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue; // a keep-alive comment
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new APIError(500, chunk);
      yield chunk;
    }
  }
}
