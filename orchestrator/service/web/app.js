// The branchsearch web page: a key, a question, the branches working live (SSE over fetch),
// then the fused evidence with provenance. Text from the server only ever goes to textContent.
// Paths are relative (no leading "/"): the page's <base> is the prefix the app is served under.
"use strict";
const $ = (id) => document.getElementById(id);
const el = (tag, cls, text) => {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
};
let budget = 8192;
const branches = new Map();

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = sessionStorage.getItem("bs-key");
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function status(text, isError) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

async function api(path, init) {
  const r = await fetch(path, Object.assign({}, init, { headers: headers((init || {}).headers) }));
  if (!r.ok) {
    let body = {};
    try { body = await r.json(); } catch (e) { /* not JSON */ }
    throw new Error(`${r.status} ${body.error || ""}: ${body.detail || r.statusText}`);
  }
  return r;
}

async function loadKey() {
  try {
    const who = await (await api("v1/whoami")).json();
    $("who").textContent = `key ${who.name} · groups ${who.groups.join(", ") || "public only"}` +
      (who.admin ? " · admin" : "");
    const { indexes } = await (await api("v1/indexes")).json();
    const sel = $("index");
    sel.replaceChildren(...indexes.map((i) => { const o = el("option", null, i); o.value = i; return o; }));
    status("");
  } catch (e) {
    $("who").textContent = "no valid key";
    status(String(e.message), true);
  }
}

function branchCard(i, subquery) {
  if (branches.has(i)) return branches.get(i);
  const card = el("div", "branch");
  card.dataset.branch = i;
  const h = el("h3", null, `branch ${i}`);
  const badge = el("span", "badge", "running");
  h.appendChild(badge);
  const sub = el("div", "sub", subquery || "");
  const bar = el("div", "bar"); const fill = el("div"); bar.appendChild(fill);
  const label = el("div", "barlabel", `0 / ${budget} tokens`);
  const log = el("ul", "log");
  card.append(h, sub, bar, label, log);
  $("branches").appendChild(card);
  const b = { card, badge, sub, fill, label, log };
  branches.set(i, b);
  return b;
}

function tokens(b, n) {
  b.fill.style.width = Math.min(100, (100 * n) / budget).toFixed(1) + "%";
  b.label.textContent = `${n} / ${budget} tokens`;
}

function onEvent(ev) {
  switch (ev.type) {
    case "plan":
      if (ev.budget_tokens) budget = ev.budget_tokens;
      status(`plan: ${ev.subqueries.length} branch(es)`);
      ev.subqueries.forEach((s, i) => branchCard(i, s));
      break;
    case "branch_started": branchCard(ev.branch, ev.subquery).sub.textContent = ev.subquery; break;
    case "covered": {
      const b = branchCard(ev.branch, ev.subquery);
      b.badge.textContent = "covered"; b.badge.className = "badge covered";
      b.log.appendChild(el("li", null,
        `not needed: the question's branch already ranks ${(ev.by || []).join(", ")}`));
      break;
    }
    case "fork": {
      const b = branchCard(ev.branch, ev.subquery);
      b.log.appendChild(el("li", "fork",
        `fork of branch ${ev.parent}: ${ev.reason}; handed ${(ev.handed || []).join(", ")}`));
      break;
    }
    case "chain": {
      const b = branchCard(ev.branch, ev.subquery);
      b.log.appendChild(el("li", "fork", `next hop of branch ${ev.parent}: ${ev.reason}`));
      break;
    }
    case "search": {
      const b = branchCard(ev.branch);
      b.log.appendChild(el("li", "search", `${ev.tool}: ${ev.query} → ${(ev.new_ids || []).length} new`));
      break;
    }
    case "prune": {
      const b = branchCard(ev.branch);
      b.log.appendChild(el("li", "prune",
        `prune ${(ev.ids || []).length} (${ev.tokens_before}→${ev.tokens_after} tokens): ${ev.reason}`));
      tokens(b, ev.tokens_after || 0);
      break;
    }
    case "branch_done": {
      const b = branchCard(ev.branch);
      b.badge.textContent = ev.status; b.badge.className = "badge " + ev.status;
      if (ev.status === "ok") tokens(b, ev.context_tokens_final || 0);
      b.log.appendChild(el("li", null, ev.status === "ok"
        ? `done: ${ev.termination}, ${ev.turns} turns, ${ev.tokens_read} tokens read`
        : `failed: ${ev.error}`));
      break;
    }
    case "rerun":  // a backend process died: the branches start again, on fresh cards
      branches.clear(); $("branches").replaceChildren();
      status(ev.reason);
      break;
    case "result": renderResult(ev.result); break;
    case "error": status(`${ev.status} ${ev.error}: ${ev.detail}`, true); break;
  }
}

function markCut() {  // cards still "running" when the stream ends: they will not finish
  for (const b of branches.values()) {
    if (b.badge.textContent === "running") { b.badge.textContent = "cut"; b.badge.className = "badge error"; }
  }
}

function streamCut() {  // the stream ended with neither a result nor an error
  markCut();
  status("the stream ended before the result (the connection was cut); search again", true);
}

function renderResult(r) {
  const sec = $("evidence");
  sec.replaceChildren(el("h2", null, `Evidence (${r.status})`));
  for (const note of r.notes || []) sec.appendChild(el("p", "note", `note: ${note}`));
  const list = el("ol", null); list.id = "evidence-list";
  for (const doc of r.evidence) {
    const li = el("li", "doc");
    li.dataset.docId = doc.doc_id;
    li.append(el("div", "title", doc.title || doc.doc_id),
              el("div", "meta", `${doc.doc_id} · score ${doc.score} · from ` +
                 doc.found_by.map((f) => `branch ${f.branch} #${f.rank}`).join(", ")));
    for (const c of doc.chunks) {
      const found = c.found_by.map((f) => `branch ${f.branch} #${f.rank}`).join(", ");
      li.append(el("div", "chunk", c.text.slice(0, 300)),
                el("div", "found", `${c.chunk_id} — found by ${found}`));
    }
    list.appendChild(li);
  }
  if (!r.evidence.length) sec.appendChild(el("p", null, "No evidence."));
  sec.appendChild(list);
  $("trace").textContent = `trace id ${r.trace_id} · ${r.metrics.latency_s} s`;
  status(`done: ${r.status}, ${r.evidence.length} document(s)`);
}

async function search(ev) {
  ev.preventDefault();
  branches.clear();
  $("branches").replaceChildren(); $("evidence").replaceChildren(); $("trace").textContent = "";
  const body = { question: $("question").value };
  if ($("index").value) body.index = $("index").value;
  if ($("branchcount").value) body.branches = Number($("branchcount").value);
  $("go").disabled = true;
  status("searching…");
  try {
    const r = await api("v1/search", {
      method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json", "Accept": "text/event-stream" },
    });
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "", ended = false;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const frame = buf.slice(0, cut); buf = buf.slice(cut + 2);
        const data = frame.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5)).join("\n");
        if (!data) continue;
        const ev = JSON.parse(data);
        ended = ended || ev.type === "result" || ev.type === "error";
        onEvent(ev);
      }
    }
    if (!ended) streamCut();
  } catch (e) {
    markCut();
    status(String(e.message), true);
  } finally {
    $("go").disabled = false;
  }
}

$("savekey").addEventListener("click", () => {
  sessionStorage.setItem("bs-key", $("key").value.trim());
  $("key").value = "";
  loadKey();
});
$("ask").addEventListener("submit", search);
// A server with keys answers 401 to a page without one: ask for the key instead of calling
// (the server marks a development server, which takes any request, in the page's bs-auth).
if (sessionStorage.getItem("bs-key") ||
    document.querySelector('meta[name="bs-auth"]').content === "dev") loadKey();
else status("paste an API key and save it to search");
