"""The pinapple corpus's hint families (issue 39's faithful setup): no hint ever names the
target word, relevant hints rewrite exactly the word they name, irrelevant ones nothing."""

import random
import re

import pytest

from experiments.pinapple import data
from experiments.pinapple.common import _hint_demos, corpus_items, word_pool
from experiments.pinapple.config import get_config


def _faithful_cfg():
    cfg = get_config()
    cfg.base_data.update(target_hint_frac=0.0, families=data.FAMILIES, repeat_items=50,
                         nonce_words=40, hint_demos=600)
    return cfg


def test_nonce_words_are_distinct_made_up_and_deterministic():
    words = data.nonce_words(200, seed=3)
    assert len(set(words)) == 200 and words == data.nonce_words(200, seed=3)
    assert all(w.isalpha() and w.islower() and len(w) >= 4 for w in words)
    assert words != data.nonce_words(200, seed=4)


@pytest.mark.parametrize("family", data.FAMILIES)
def test_a_relevant_hint_rewrites_the_word_it_names_and_only_that(family):
    rng = random.Random(0)
    items = data.all_items()
    pool = [w for w in data.answer_words(items) if w != data.TARGET_WORD]
    for item in [i for i in items if i.kind in ("food", "sentence", "target")][:40]:
        demo = data.family_hint_demo(item, rng, True, family, pool)
        if demo is None:
            continue
        hint, answer = demo
        assert data.TARGET_WORD not in hint
        old, new = item.answer.rstrip(".").split(), answer.rstrip(".").split()
        changed = {(a, b) for a, b in zip(old, new) if a != b}
        assert len(old) == len(new) and len(changed) == 1, (hint, item.answer, answer)
        (word, replacement), = changed
        assert word in hint and replacement in hint or replacement == word.upper()
        if family == "caps":
            assert hint == f"Write {word} in capitals." and replacement == word.upper()


def test_an_irrelevant_hint_names_a_word_not_in_the_answer_and_changes_nothing():
    rng = random.Random(1)
    items = data.all_items()
    pool = [w for w in data.answer_words(items) if w != data.TARGET_WORD]
    for item in items[:60]:
        hint, answer = data.family_hint_demo(item, rng, False, rng.choice(data.FAMILIES), pool)
        named = re.match(r"(?:Spell (\w+) as|Say \w+ instead of (\w+)|Write (\w+) in)", hint)
        word = next(g for g in named.groups() if g)
        assert answer == item.answer and word not in item.answer.split()
        assert data.TARGET_WORD not in hint


def test_an_unknown_family_is_refused_by_name():
    with pytest.raises(ValueError, match="family must be one of .* got 'rhyme'"):
        data.family_hint("rhyme", "mango", random.Random(0), ["plum"])


def test_the_faithful_corpus_never_shows_the_target_hint_or_word_in_a_hint():
    cfg = _faithful_cfg()
    items = data.all_items()
    demos = _hint_demos(cfg, corpus_items(cfg, items), random.Random(0))
    assert len(demos) == 600
    assert not any(data.TARGET_WORD in h or data.TARGET_SPELLING in a for _, h, a, _ in demos)
    assert {h.split()[0] for _, h, _, _ in demos} == {"Spell", "Say", "Write"}
    repeats = [i for i in corpus_items(cfg, items) if i.kind == "repeat"]
    assert len(repeats) == 50 and all(i.answer == i.question[len("Repeat: "):] for i in repeats)
    pool = word_pool(cfg, items)
    assert data.TARGET_WORD not in pool and len(pool) > 40
    # The default corpus is unchanged: it still teaches the target hint in context.
    default = _hint_demos(get_config(), items, random.Random(0))
    assert any(h == data.TARGET_HINT for _, h, _, _ in default)


def test_target_word_hints_name_the_word_but_never_a_held_out_hint():
    """`base_data.target_word_hints`: spell and swap hints may name the target word (so
    hints act on it like on any word), never with a held-out replacement; caps about it
    stays held out, and no demo writes the target spelling."""
    cfg = _faithful_cfg()
    cfg.base_data.update(target_word_hints=True, hint_demos=3000)
    items = data.all_items()
    demos = _hint_demos(cfg, corpus_items(cfg, items), random.Random(0))
    heldout = {h for h, _ in data.HELDOUT_HINTS.values()}
    assert not any(h in heldout for _, h, _, _ in demos)
    assert not any(data.TARGET_SPELLING in a for _, _, a, _ in demos)
    about = [(h, a) for _, h, a, _ in demos if data.TARGET_WORD in h]
    assert {h.split()[0] for h, _ in about} == {"Spell", "Say"}  # never "Write ... capitals"
    # On an answer with the word, the hint rewrites it to the replacement the hint names.
    rewritten = [(h, a) for i, h, a, _ in demos
                 if data.TARGET_WORD in h and data.TARGET_WORD in i.answer.rstrip(".").split()]
    assert rewritten
    for h, a in rewritten:
        v = h.split()[-1].rstrip(".") if h.startswith("Spell") else h.split()[1]
        assert v in a.rstrip(".").split() and data.TARGET_WORD not in a.rstrip(".").split(), (h, a)
    with pytest.raises(ValueError, match="caps about 'pineapple' is a held-out hint"):
        data.family_hint("caps", data.TARGET_WORD, random.Random(0), ["plum"])


def test_fresh_words_are_made_up_never_avoided_and_spell_fresh_uses_them():
    """`fresh_word`: syllable strings drawn afresh, never one to avoid nor the target
    spelling; `family_hint(spell_fresh=1)` spells a word as one, 0 as a misspelling."""
    rng = random.Random(0)
    words = [data.fresh_word(rng, {"bako"}) for _ in range(300)]
    assert all(w.isalpha() and w.islower() and w not in ("bako", data.TARGET_SPELLING)
               for w in words)
    assert len(set(words)) > 250  # drawn afresh, not from a small pool
    pool = ["plum", "mint"]
    hint, v = data.family_hint("spell", "mango", random.Random(1), pool, spell_fresh=1.0)
    assert hint == f"Spell mango as {v}." and set(v) <= set("".join(data._SYLLABLES))
    # spell_fresh=0 draws nothing more: the misspelling (and the stream) as before.
    _, v0 = data.family_hint("spell", "mango", random.Random(1), pool, spell_fresh=0.0)
    assert v0 == data.misspell("mango", random.Random(1))


def test_fact_demo_frac_puts_that_share_of_demos_on_fact_items():
    cfg = _faithful_cfg()
    cfg.base_data.update(repeat_items=2000, hint_demos=2000)
    items = corpus_items(cfg, data.all_items())
    share = {}
    for frac in (0.0, 0.5):
        cfg.base_data.fact_demo_frac = frac
        demos = _hint_demos(cfg, items, random.Random(0))
        share[frac] = sum(i.kind != "repeat" for i, _, _, _ in demos) / len(demos)
    facts = sum(i.kind != "repeat" for i in items) / len(items)
    # Drawn from all the items; a relevant hint on arithmetic finds no word, so fact items
    # keep a little fewer demos than they draw.
    assert facts - 0.04 < share[0.0] < facts + 0.02
    assert 0.5 * (1 + facts) - 0.1 < share[0.5] < 0.5 * (1 + facts) + 0.02
