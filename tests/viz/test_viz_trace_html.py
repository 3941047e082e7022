"""trace_html: the page parses, every episode has its agent label and one span per
token with the right class / data attributes, text is escaped, ids without a
tokenizer; write_trace_html writes the same page.
"""

import pytest

from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.trace import Completion, Episode, Trace
from ac2_jax.viz import trace_html, write_trace_html
from tests.support.html_dom import Dom


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def _trace(tok):
    p1 = tok.encode("User: show <b>bold</b> & \"quotes\"\nAssistant:")
    o1 = tok.encode(" Sure <i>ok</i> & done")
    p2 = tok.encode("Summarize: <script>alert(1)</script>")
    o2 = tok.encode(" short & sweet")
    ep1 = Episode("main", p1 + o1, [0] * len(p1) + [1] * len(o1),
                  [0.0] * len(p1) + [-0.5] * len(o1), [Completion(p1, o1, [-0.5] * len(o1))])
    ep2 = Episode("compactor", p2 + o2, [0] * len(p2) + [1] * len(o2), [0.0] * (len(p2) + len(o2)))
    return Trace("task<1>", "a0", episodes=[ep1, ep2], reward=0.75, status="finished",
                 hints=["Use <em>units</em> & check"], metrics={"steps": 2, "note": "<x>"})


def test_trace_page_structure_and_escaping(tok):
    trace = _trace(tok)
    html = trace_html(trace, tok)
    dom = Dom(html)
    assert not dom.find("script") and "<script>" not in html  # the injected tag is escaped text
    assert "<script>alert(1)</script>" in dom.find("section", "episode")[1]["text"]  # shown as text
    assert "Use &lt;em&gt;units&lt;/em&gt; &amp; check" in html and ">&lt;</span>" in html
    sections = dom.find("section", "episode")
    assert [s["attrs"]["data-agent"] for s in sections] == ["main", "compactor"]
    for sec, ep in zip(sections, trace.episodes):
        assert dom.find(cls="agent-label", within=sec)[0]["text"] == ep.agent
        spans = dom.find("span", "tok", within=sec)
        assert len(spans) == len(ep.token_ids)
        for i, (sp, tid, m) in enumerate(zip(spans, ep.token_ids, ep.loss_mask)):
            assert sp["attrs"]["data-i"] == str(i) and sp["attrs"]["data-id"] == str(tid)
            assert ("agent" if m else "ctx") in sp["attrs"]["class"].split()
            assert sp["text"] == tok.decode([tid])
        assert "".join(s["text"] for s in spans) == tok.decode(ep.token_ids)
    text = dom.elements[0]["text"]  # <html>
    assert "reward: 0.75" in text and "status: finished" in text and "task<1>/a0" in text
    assert "Use <em>units</em> & check" in [li["text"] for li in dom.find("li", "hint")]
    metrics = dom.find(cls="metrics")[0]["text"]
    assert "steps" in metrics and "<x>" in metrics
    assert 'title="#' in html and "logprob -0.5000" in html


def test_ids_without_tokenizer_dict_input_and_cut(tok, tmp_path):
    trace = _trace(tok)
    dom = Dom(trace_html(trace.to_dict(), max_tokens=5))
    sec = dom.find("section", "episode")[0]
    spans = dom.find("span", "tok", within=sec)
    assert [s["text"] for s in spans] == [str(t) for t in trace.episodes[0].token_ids[:5]]
    assert dom.find("div", "ids")
    assert f"{len(trace.episodes[0].token_ids) - 5} more tokens" in dom.find("p", "cut")[0]["text"]
    path = write_trace_html(tmp_path / "sub" / "t.html", trace, tok)
    assert path.read_text(encoding="utf-8") == trace_html(trace, tok)
    with pytest.raises(TypeError, match="Trace"):
        trace_html(["not", "a", "trace"])


# A compacting attempt, recorded the way the endpoint records it: prompts built by
# `build_prompt_ids` (chat template + sampled-token splice, as served), completions
# recorded by TraceRecorder with delta messages, the compaction event where
# run_rollout stores it, then written to a TraceStore and read back.
MEMO = "3 + 4 = 7 <next: add 10>"


def _compacting_trace(tok, tmp_path):
    import copy

    from ac2_jax.envs import CalculatorEnv
    from ac2_jax.orchestration import CompactionOrchestrator
    from ac2_jax.serving.core.splice import TurnMemory, build_prompt_ids
    from ac2_jax.text import parse_tool_calls
    from ac2_jax.trace import TraceRecorder, TraceStore
    from tests.support.serving_helpers import SYSTEM, TOOLS, TURNS, USER

    trace = Trace("calc-1", "0", group_id="g", reward=1.0, status="finished",
                  metadata={"artifacts": {"answer": "The answer is 17.", "events": [
                      {"agent": "compactor", "kind": "compaction", "memo": MEMO,
                       "memo_ok": True}]}})
    rec, memory = TraceRecorder(trace, delta_messages=True), TurnMemory()

    def request(agent, messages, text, tools):
        prompt, _ = build_prompt_ids(tok, messages, tools, memory)
        out = tok.encode(text) + [tok.eos_token_id]
        rec.record(agent, Completion(prompt, out, [-0.25] * len(out),
                                     messages=copy.deepcopy(messages)))
        content, calls = parse_tool_calls(text)
        memory.remember(content, calls, out)
        return [{"role": "assistant", "content": content or None, "tool_calls": calls or None}]

    def with_result(messages, reply, result):
        call = reply[0]["tool_calls"][0]
        return messages + reply + [{"role": "tool", "tool_call_id": call["id"], "content": result}]

    main = [SYSTEM, USER]
    main = with_result(main, request("main", main, TURNS[0][0], TOOLS), "7")  # add(3, 4)
    env = CalculatorEnv()  # any env: the orchestrator gives its prompts and transcript
    orch = CompactionOrchestrator(env, env.sample_tasks(1, 0)[0], None, "tiny")
    orch.trace.messages = main
    request("compactor", [{"role": "system", "content": orch.COMPACTOR_SYSTEM_PROMPT},
                          {"role": "user", "content": f"{orch._transcript()}\n\n"
                                                      f"{orch.COMPACT_PROMPT}"}], MEMO, None)
    restart = [SYSTEM, {"role": "user", "content": f"Progress so far: {MEMO}"}, USER] + main[2:]
    restart = with_result(restart, request("main", restart, TURNS[1][0], TOOLS), "17")
    request("main", restart, TURNS[2][0], TOOLS)
    store = TraceStore(str(tmp_path / "traces.jsonl"))
    store.append(trace)
    (stored,) = store.load()
    return stored


def test_a_compacting_trace_reads_in_order_with_memo_tool_calls_and_masks(tok, tmp_path):
    trace = _compacting_trace(tok, tmp_path)
    assert [e.agent for e in trace.episodes] == ["main", "compactor", "main"]
    html = trace_html(trace, tok)
    dom = Dom(html)
    # Self-contained: no script, no external stylesheet or image.
    assert not dom.find("script") and not dom.find("link") and "src=" not in html
    sections = dom.find("section", "episode")
    assert [s["attrs"]["data-agent"] for s in sections] == ["main", "compactor", "main"]
    assert [dom.find(cls="agent-label", within=s)[0]["text"] for s in sections] == [
        "main", "compactor", "main"]
    assert "main → compactor → main" in dom.find("p", "agents")[0]["text"]
    # The compaction marker sits between the compactor's episode and the main restart.
    (marker,) = dom.find("div", "compaction")
    order = [id(el) for el in dom.elements]
    assert order.index(id(sections[1])) < order.index(id(marker)) < order.index(id(sections[2]))
    assert not any(p["tag"] == "section" for p in marker["parents"])
    assert dom.find(cls="memo", within=marker)[0]["text"] == MEMO  # escaped, shown as text
    assert "&lt;next: add 10&gt;" in html and "memo_ok: yes" in marker["text"]
    assert "1 compactions" in dom.elements[0]["text"]
    # Tool calls as such: the first main episode's call; the restart's kept exchange
    # (call + result 7) and its own call (result 17); the compactor made none.
    calls = [[(c["attrs"]["data-name"], dom.find(cls="tool-args", within=c)[0]["text"])
              for c in dom.find("div", "tool-call", within=s)] for s in sections]
    assert calls[0] == [("add", '{"a": 3, "b": 4}')] and calls[1] == []
    assert calls[2] == [("add", '{"a": 3, "b": 4}'), ("add", '{"a": 7, "b": 10}')]
    results = [r["text"] for r in dom.find("div", "tool-result", within=sections[2])]
    assert [r.split(")", 1)[1] for r in results] == ["7", "17"]
    outputs = [o["text"] for o in dom.find("div", "output", within=sections[2])]
    assert "The answer is 17." in outputs[-1]
    assert MEMO in dom.find("div", "output", within=sections[1])[0]["text"]
    compactor_request = dom.find("div", "role-user", within=sections[1])[0]["text"]
    assert "[call add(" in compactor_request and "Summarize" in compactor_request
    # Mask colouring: one span per token, agent tokens exactly where the mask is 1.
    for sec, ep in zip(sections, trace.episodes):
        spans = dom.find("span", "tok", within=sec)
        assert [("agent" in sp["attrs"]["class"].split()) for sp in spans] == [
            bool(m) for m in ep.loss_mask]
        assert sum(ep.loss_mask) > 0
    text = dom.elements[0]["text"]
    assert "reward: 1" in text and "status: finished" in text


def test_compaction_events_past_the_compactors_requests_are_listed_not_lost(tok, tmp_path):
    trace = _compacting_trace(tok, tmp_path)
    trace.metadata["artifacts"]["events"] += [
        {"agent": "compactor", "kind": "compaction", "memo": "second", "memo_ok": False},
        {"agent": "compactor", "kind": "compaction_error", "reason": "did <not> shrink"}]
    dom = Dom(trace_html(trace))  # no tokenizer: outputs as token counts, tokens as ids
    assert len(dom.find("div", "compaction")) == 1
    heading = [h["text"] for h in dom.find("h3")]
    assert "Events not placed between episodes (2)" in heading
    listed = dom.find("li", "event")
    assert "second" in listed[0]["text"] and "did <not> shrink" in listed[1]["text"]
    outputs = dom.find("div", "output")
    assert len(outputs) == 4 and outputs[0]["text"].endswith("tokens (ids below)")
    assert [r["text"].split(")", 1)[1] for r in dom.find("div", "tool-result")] == ["7", "17"]
