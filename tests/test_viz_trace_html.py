"""trace_html: the page parses, every episode has its agent label and one span per
token with the right class / data attributes, text is escaped, ids without a
tokenizer; write_trace_html writes the same page.
"""

import pytest

from ac2_jax.models.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.trace import Completion, Episode, Trace
from ac2_jax.viz import trace_html, write_trace_html
from html_dom import Dom


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
