"""distill_report_html: hint highlighted, divergence heatmap spans with their
classes / data attributes, toggles, ranked candidates, embedded curves, no
external resources, escaping, and clear errors.
"""

import base64

import pytest

from ac2_jax.trace import Episode, Trace
from ac2_jax.viz import distill_report_html
from ac2_jax.viz.distill_report import write_distill_report
from tests.support.html_dom import Dom

TOKENS = ["The", " area", " is", " 3", " +", " 4", " =", " 7", " <ok>", " &", " done"]
DIV = [0.01, 0.2, 0.05, 0.3, 2.0, 0.4, 0.1, 1.2, 0.02, 0.0, 0.03]
CANDS = [4, 7, 5, 3]
SEL = [4, 7]
HINT = "Hint: area = width * height, not width + height <b>!</b>"
PROMPT = "User: a 3 by 4 rectangle & its area?\nAssistant:"


def _report(**kw):
    args = dict(prompt=PROMPT, hint=HINT, response_tokens=TOKENS, divergence=DIV,
                candidates=CANDS, selected=SEL, info={"step": 12, "kind": "reverse_kl"})
    args.update(kw)
    return distill_report_html(**args)


def test_hint_context_and_escaping():
    html = _report()
    dom = Dom(html)
    assert dom.find("pre", id="student")[0]["text"] == PROMPT
    teacher = dom.find("pre", id="teacher")[0]
    marks = dom.find("mark", "hint", within=teacher)
    assert [m["text"] for m in marks] == [HINT]
    assert teacher["text"] == PROMPT + HINT
    assert "&lt;b&gt;!&lt;/b&gt;" in html and "<b>" not in html and "&amp; its area" in html
    # The hint inside an explicit teacher prompt is highlighted where it occurs.
    tp = f"System: be careful.\n{HINT}\n{PROMPT}"
    dom2 = Dom(_report(teacher_prompt=tp))
    teacher2 = dom2.find("pre", id="teacher")[0]
    assert teacher2["text"] == tp and dom2.find("mark", "hint", within=teacher2)[0]["text"] == HINT


def test_heatmap_spans_classes_and_toggles():
    dom = Dom(_report())
    resp = dom.find("div", id="response")[0]
    assert resp["attrs"]["data-view"] == "all"
    spans = dom.find("span", "tok", within=resp)
    assert [s["text"] for s in spans] == TOKENS  # escaped " <ok>" and " &" read back exactly
    for i, s in enumerate(spans):
        cls = s["attrs"]["class"].split()
        assert s["attrs"]["data-pos"] == str(i)
        assert float(s["attrs"]["data-div"]) == pytest.approx(DIV[i], rel=1e-5)
        assert ("cand" in cls) == (i in CANDS) and ("sel" in cls) == (i in SEL)
        assert s["attrs"]["style"] == f"--h:{DIV[i] / max(DIV):.3f}"
    ids = {el["attrs"]["id"]: el["attrs"] for el in dom.find("input")}
    assert set(ids) == {"view-all", "view-topT", "view-topS"}
    assert {a["value"] for a in ids.values()} == {"all", "topT", "topS"}
    assert all(a["name"] == "view" and a["type"] == "radio" for a in ids.values())
    assert "checked" in ids["view-all"]
    script = dom.find("script")[0]["text"]
    assert "data-view" in script and "input[name=\"view\"]" in script
    style = dom.find("style")[0]["text"]
    assert '[data-view="topT"] .tok:not(.cand)' in style and '[data-view="topS"] .tok:not(.sel)' in style
    labels = " ".join(el["text"] for el in dom.find("label"))
    assert "top-T candidates (4)" in labels and "judge top-S (2)" in labels
    # Candidate table: ranked by divergence, judge selections flagged.
    rows = dom.find("tr", within=dom.find("table", "cands")[0])[1:]
    assert [r["text"].split("'")[0] for r in rows] == ["04", "17", "25", "33"]  # rank, pos
    assert [r["attrs"]["class"] for r in rows] == ["sel", "sel", "cand", "cand"]


def test_curves_embedded_and_self_contained(tmp_path):
    metrics = {"target": [0.1, 0.4, 0.6], "retention": [0.9, 0.88, 0.87], "loss": [1.0, 0.6, 0.4]}
    trace = Trace("t1", episodes=[Episode("main", [5, 6, 7], [0, 1, 1], [0.0, -0.1, -0.2])],
                  reward=1.0, status="finished")
    html = _report(metrics=metrics, trace=trace)
    dom = Dom(html)
    img = dom.find("img", "curves")[0]
    src = img["attrs"]["src"]
    assert src.startswith("data:image/png;base64,")
    assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "target metric" in img["attrs"]["alt"] and "retention metric" in img["attrs"]["alt"]
    assert not dom.find("link") and "http://" not in html and "https://" not in html
    assert all("src" not in el["attrs"] for el in dom.find("script"))
    assert [s["attrs"]["data-agent"] for s in dom.find("section", "episode")] == ["main"]
    path = write_distill_report(tmp_path / "r" / "report.html", prompt=PROMPT, hint=HINT,
                                response_tokens=TOKENS, divergence=DIV)
    assert path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    with pytest.raises(KeyError, match="retention"):
        _report(metrics={"target": [1.0], "loss": [1.0]})
    custom = Dom(_report(metrics={"acc": [0.1, 0.2]}, curves={"target metric": "acc"}))
    assert custom.find("img", "curves")


def test_bad_inputs():
    with pytest.raises(ValueError, match="divergences"):
        _report(divergence=DIV[:-1])
    with pytest.raises(ValueError, match="candidate positions \\[11\\]"):
        _report(candidates=[1, 11])
    with pytest.raises(ValueError, match="selected"):
        _report(selected=[-1])
    with pytest.raises(ValueError, match="teacher_prompt"):
        _report(teacher_prompt="no hint here")
    with pytest.raises(ValueError, match="hint is empty"):
        _report(hint="")


def test_heatmap_fragment_matches_the_page_and_several_fit_on_one_page():
    from ac2_jax.viz import HEATMAP_CSS, heatmap_html, page

    frag = heatmap_html(TOKENS, DIV, CANDS, SEL)
    two = Dom(page("t", frag + heatmap_html(TOKENS[:3], DIV[:3], [1], [1]), css=HEATMAP_CSS))
    heats = two.find("div", "heat")
    assert len(heats) == 2 and not any("id" in h["attrs"] for h in heats)
    spans = two.find("span", "tok", within=heats[0])
    full = Dom(_report())
    page_spans = full.find("span", "tok", within=full.find("div", id="response")[0])
    assert [(s["text"], s["attrs"]) for s in spans] == [(s["text"], s["attrs"])
                                                        for s in page_spans]
    assert len(two.find("table", "cands")) == 2
    assert ".heat .tok.sel" in two.find("style")[0]["text"]
    with pytest.raises(ValueError, match="2 divergences for 3 response tokens"):
        heatmap_html(TOKENS[:3], DIV[:2])
    with pytest.raises(ValueError, match=r"heatmap_html: selected positions \[9\]"):
        heatmap_html(TOKENS[:3], DIV[:3], [1], [9])
