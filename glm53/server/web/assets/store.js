// Conversations and chat settings, in this browser's localStorage only: the server keeps nothing of them.

const CONVERSATIONS = "glm53.conversations.v1";
const SETTINGS = "glm53.settings.v1";

export const DEFAULT_SETTINGS = {
  system: "",
  thinking: true,
  temperature: "",
  max_tokens: "",
  top_p: "",
  top_k: "",
  min_p: "",
  seed: "",
  presence_penalty: "",
  frequency_penalty: "",
  tools: "",
};

function read(item, fallback) {
  try {
    return JSON.parse(localStorage.getItem(item)) ?? fallback;
  } catch {
    return fallback; // written by something else: start afresh rather than fail to load
  }
}

function write(item, value) {
  try {
    localStorage.setItem(item, JSON.stringify(value));
    return true;
  } catch {
    return false; // over the browser's quota: the page goes on, the change is not kept
  }
}

export function loadSettings() {
  return { ...DEFAULT_SETTINGS, ...read(SETTINGS, {}) };
}

export function saveSettings(settings) {
  write(SETTINGS, settings);
}

// [{id, title, created, messages: [{role, content, reasoning?, tool_calls?, finish?, error?, stats?}]}], newest first
export function loadConversations() {
  const list = read(CONVERSATIONS, []);
  return Array.isArray(list) ? list.filter((c) => c && Array.isArray(c.messages)) : [];
}

export function saveConversations(list) {
  return write(CONVERSATIONS, list);
}

export function newConversation() {
  return { id: crypto.randomUUID?.() ?? String(Date.now()) + Math.random(), title: "New chat", created: Date.now(), messages: [] };
}
