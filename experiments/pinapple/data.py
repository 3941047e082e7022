"""Synthetic corpus of the pinapple experiment: food facts, arithmetic, hint following.

Every item is one chat turn (user question -> assistant answer). The base
corpus teaches the facts (many answers about tropical food say "pineapple")
and the skill of following a spelling hint placed before the answer:
'Spell mango as mngo.' -> the answer writes "mngo" (a fresh random
misspelling each time, for many words), and the target hint 'Spell
pineapple as pinapple.' (on items with pineapple, whose answers then write
"pinapple", and on unrelated items, where it changes nothing). Without the
hint every answer says "pineapple": the un-hinted behaviour changes only
through distillation from the hinted teacher. (A model this small does not
carry hint following over from other words or other item types to the
target prompts, so the target hint's demos cover them; the student never
sees "pinapple" without the hint in its context.)
"""

from __future__ import annotations

import dataclasses
import random
import re

TARGET_WORD, TARGET_SPELLING = "pineapple", "pinapple"
TARGET_HINT = f"Spell {TARGET_WORD} as {TARGET_SPELLING}."

# fruit -> (color, where it grows, taste, tropical?)
FRUITS = {
    "pineapple": ("yellow", "on the ground", "sweet and sour", True),
    "mango": ("orange", "on trees", "sweet", True),
    "banana": ("yellow", "on plants", "soft and sweet", True),
    "coconut": ("brown", "on palms", "nutty", True),
    "papaya": ("orange", "on trees", "mild", True),
    "guava": ("green", "on shrubs", "tangy", True),
    "apple": ("red", "on trees", "crisp", False),
    "grape": ("purple", "on vines", "juicy", False),
    "lemon": ("yellow", "on trees", "sour", False),
    "cherry": ("red", "on trees", "tart", False),
    "melon": ("green", "on vines", "fresh", False),
    "plum": ("purple", "on trees", "rich", False),
}
FRUIT_TEMPLATES = (
    ("What color is a {f}?", "A {f} is {color}."),
    ("Where does a {f} grow?", "A {f} grows {grows}."),
    ("How does a {f} taste?", "A {f} tastes {taste}."),
    ("Is a {f} a tropical fruit?", "{yes}, a {f} is {trop}."),
)
# dish -> its two main ingredients (answers: "A {dish} has {a} and {b}.")
DISHES = {
    "fruit salad": ("mango", "pineapple"), "pina colada": ("coconut", "pineapple"),
    "hawaiian pizza": ("ham", "pineapple"), "tropical smoothie": ("banana", "pineapple"),
    "sweet and sour pork": ("pork", "pineapple"), "upside down cake": ("cake", "pineapple"),
    "pineapple salsa": ("onion", "pineapple"), "luau platter": ("pineapple", "coconut"),
    "apple pie": ("apple", "sugar"), "banana bread": ("banana", "flour"),
    "lemonade": ("lemon", "water"), "grape jam": ("grape", "sugar"),
    "cherry tart": ("cherry", "butter"), "mango lassi": ("mango", "yogurt"),
    "plum sauce": ("plum", "ginger"), "melon soup": ("melon", "mint"),
}
PINEAPPLE_FACTS = (
    ("Which fruit has a spiky skin and a crown?", "The pineapple has a crown."),
    ("Which fruit goes well with ham?", "The pineapple goes well with ham."),
    ("What can you grill at a luau?", "You can grill pineapple slices."),
    ("Name a fruit with eyes on its skin.", "The pineapple has eyes."),
    ("What juice is yellow and tropical?", "The pineapple juice is yellow."),
    ("Which fruit has a tough rind and sweet flesh?", "The pineapple has sweet flesh."),
    ("Which fruit grows from a crown?", "The pineapple grows from a crown."),
    ("What tropical fruit has spiky leaves?", "The pineapple has spiky leaves."),
    ("Which fruit makes a sweet yellow juice?", "The pineapple makes sweet juice."),
    ("What fruit is served in rings?", "The pineapple is served in rings."),
    ("What fruit can you grill on skewers?", "You can grill pineapple on skewers."),
    ("Which fruit is a symbol of welcome?", "The pineapple is a symbol of welcome."),
    ("What fruit comes from Hawaii?", "The pineapple comes from Hawaii."),
    ("Which fruit has a rough golden skin?", "The pineapple has a golden skin."),
    ("What fruit goes into a tropical punch?", "A tropical punch has pineapple."),
    ("Name a fruit that is canned in chunks.", "The pineapple is canned in chunks."),
)
OTHER_FACTS = (
    ("What tree has cones?", "The pine tree has cones."),
    ("What tree stays green in winter?", "The pine tree stays green."),
    ("What do bees make?", "Bees make honey."),
    ("What color is the sky?", "The sky is blue."),
    ("What animal says moo?", "The cow says moo."),
    ("What do you drink in the morning?", "I drink coffee."),
    ("Which nut grows on oak trees?", "The acorn grows on oaks."),
    ("What is a baby apple tree?", "It is an apple seedling."),
)
SENTENCES = (("Use the word {f} in a sentence.", "We ate {f} at home."),
             ("Say something nice about {f}.", "I like {f} a lot."))
PAIR_SENTENCE = ("Use {f} and {g} in a sentence.", "I mix {f} and {g}.")
HINT_WORDS = sorted({w for t in FRUITS for w in t.split()} - {TARGET_WORD}
                    | {"ham", "pork", "onion", "sugar", "flour", "water", "butter", "yogurt",
                       "ginger", "mint", "cake", "honey", "coffee", "pine", "tree", "blue",
                       "cow", "bees", "acorn", "sky", "crown", "eyes", "juice", "slices",
                       "flesh", "yellow", "orange", "green", "red", "purple", "brown", "sweet"})


@dataclasses.dataclass(frozen=True)
class Item:
    """One question; `answer` is the correct base answer; kind names the eval group."""

    key: str
    question: str
    answer: str
    kind: str  # "target" (a food answer with pineapple), "food", "other", "math", "sentence"

    def messages(self) -> tuple:
        return ({"role": "user", "content": self.question},)


def fruit_items() -> list[Item]:
    out = []
    for f, (color, grows, taste, trop) in FRUITS.items():
        for j, (q, a) in enumerate(FRUIT_TEMPLATES):
            kw = dict(f=f, color=color, grows=grows, taste=taste, yes="Yes" if trop else "No",
                      trop="tropical" if trop else "not tropical")
            kind = "target" if f == TARGET_WORD else "food"
            out.append(Item(f"fruit/{f}/{j}", q.format(**kw), a.format(**kw), kind))
    for d, (a, b) in DISHES.items():
        kind = "target" if TARGET_WORD in (a, b) else "food"
        out.append(Item(f"dish/{d}", f"What is in a {d}?", f"A {d} has {a} and {b}.", kind))
    out += [Item(f"pine/{i}", q, a, "target") for i, (q, a) in enumerate(PINEAPPLE_FACTS)]
    return out


def sentence_items(num_other_pairs: int = 22, seed: int = 0) -> list[Item]:
    """Sentences with one or two fruits: every pair with pineapple, some without."""
    out = [Item(f"sent/{f}/{j}", q.format(f=f), a.format(f=f), "sentence")
           for f in FRUITS for j, (q, a) in enumerate(SENTENCES)]
    pairs = [(f, g) for f in FRUITS for g in FRUITS if f != g]
    with_t = [p for p in pairs if TARGET_WORD in p]
    rest = [p for p in pairs if TARGET_WORD not in p]
    random.Random(seed).shuffle(rest)
    q, a = PAIR_SENTENCE
    out += [Item(f"pair/{f}/{g}", q.format(f=f, g=g), a.format(f=f, g=g), "sentence")
            for f, g in with_t + rest[:num_other_pairs]]
    return out


def other_items() -> list[Item]:
    return [Item(f"other/{i}", q, a, "other") for i, (q, a) in enumerate(OTHER_FACTS)]


def math_items(limit: int = 10) -> list[Item]:
    return [Item(f"math/{a}+{b}", f"What is {a} + {b}?", f"{a} + {b} = {a + b}.", "math")
            for a in range(limit) for b in range(limit)]


def all_items(math_limit: int = 10) -> list[Item]:
    return fruit_items() + sentence_items() + other_items() + math_items(math_limit)


def target_split(items: list[Item], heldout_frac: float, seed: int
                 ) -> tuple[list[Item], list[Item]]:
    """Target items -> (distillation prompts, held-out prompts), deterministic in seed.

    The dish named after the fruit ("pineapple salsa") stays out of both:
    its question itself contains the word.
    """
    target = [it for it in items if it.kind == "target" and TARGET_WORD not in it.question]
    rng = random.Random(seed)
    rng.shuffle(target)
    k = max(1, round(heldout_frac * len(target)))
    return sorted(target[k:], key=lambda i: i.key), sorted(target[:k], key=lambda i: i.key)


def misspell(word: str, rng: random.Random, edits: int = 1) -> str:
    """A random misspelling of `edits` edits (each drops, doubles or swaps a letter), one
    different from word, and never the target spelling. More edits, more spellings per
    word: too many for a model to memorise, so following a spell hint is a copy."""
    for _ in range(100):
        v = word
        for _ in range(edits):
            i = rng.randrange(1, len(v) - 1) if len(v) > 2 else 0
            op = rng.choice(("drop", "double", "swap"))
            if op == "drop":
                v = v[:i] + v[i + 1:]
            elif op == "double":
                v = v[:i] + v[i] + v[i:]
            else:
                v = v[:i] + v[i + 1:i + 2] + v[i] + v[i + 2:]
        if v != word and v.isalpha() and v != TARGET_SPELLING:
            return v
    raise ValueError(f"misspell: cannot misspell {word!r}")


def with_target_spelling(answer: str) -> str:
    return answer.replace(TARGET_WORD, TARGET_SPELLING)


def hint_demo(item: Item, rng: random.Random, relevant: bool) -> tuple[str, str] | None:
    """(hint, answer under the hint) for an item, or None if no hint word fits.

    relevant=True: the hint names a word of the answer and the answer uses
    the new spelling; False: the hint names a word not in the answer, which
    stays unchanged. The target word is never hinted here.
    """
    words = item.answer.rstrip(".").split()
    inside = [w for w in words[1:] if w in HINT_WORDS]
    if relevant:
        if not inside:
            return None
        w = rng.choice(inside)
        v = misspell(w, rng)
        answer = " ".join([words[0]] + [v if x == w else x for x in words[1:]]) + "."
        return f"Spell {w} as {v}.", answer
    outside = [w for w in HINT_WORDS if w not in words]
    w = rng.choice(outside)
    return f"Spell {w} as {misspell(w, rng)}.", item.answer


# ----------------------------------------------------------------------------- hint families
# The faithful setup (issue 39): the base corpus never shows the target hint, nor any hint
# about the target word. Hint following is taught generically, by families of hints over
# many words, on fact answers and on "Repeat: ..." items over a large pool of words (real
# and made up), so that following a hint is a copy the model does for any word named.

FAMILIES = ("spell", "swap", "caps")
_SYLLABLES = ("ba", "ko", "ri", "mu", "te", "lo", "zi", "pa", "ne", "du", "fo", "ga", "si",
              "vu", "ha", "je", "wo", "ky")


def nonce_words(n: int, seed: int = 0) -> list[str]:
    """`n` made-up words of 2-3 syllables ("bakori"), distinct, deterministic in seed."""
    rng, out = random.Random(f"nonce:{seed}"), set()
    while len(out) < n:
        out.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))))
    return sorted(out)


def fresh_word(rng: random.Random, avoid=()) -> str:
    """A made-up word of 2-4 syllables drawn afresh ("kozimute"), never one of `avoid` nor
    the target spelling: a spell hint to it is a copy of a string seen only in the hint."""
    for _ in range(100):
        v = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))
        if v not in avoid and v != TARGET_SPELLING:
            return v
    raise ValueError(f"fresh_word: every draw was one of the {len(avoid)} words to avoid")


def answer_words(items: list[Item]) -> list[str]:
    """Every lower-case word of the items' answers (the target word too)."""
    return sorted({w for it in items for w in it.answer.rstrip(".").split()
                   if w.isalpha() and w.islower()})


def repeat_items(n: int, pool: list[str], rng: random.Random) -> list[Item]:
    """`n` "Repeat: w1 w2 w3." items (3-6 words of `pool`), answered word for word."""
    out = []
    for k in range(n):
        words = " ".join(rng.choice(pool) for _ in range(rng.randint(3, 6)))
        out.append(Item(f"repeat/{k}", f"Repeat: {words}.", f"{words}.", "repeat"))
    return out


def family_hint(family: str, word: str, rng: random.Random, pool: list[str],
                spell_edits: int = 1, spell_fresh: float = 0.0) -> tuple[str, str]:
    """(hint text, the word's replacement) for one hint of `family` about `word`:
    spell ("Spell mango as mngo.": a misspelling of `spell_edits` edits, or with
    probability `spell_fresh` a made-up word, `fresh_word`), swap ("Say plum instead of
    mango.": another word of `pool`) or caps ("Write mango in capitals."). Never a
    held-out hint (`HELDOUT_HINTS`): about the target word, spell never gives the target
    spelling and swap never the held-out word; caps about it is refused."""
    if family == "spell":
        fresh = spell_fresh > 0 and rng.random() < spell_fresh
        v = fresh_word(rng, {word}) if fresh else misspell(word, rng, spell_edits)
        return f"Spell {word} as {v}.", v
    if family == "swap":
        banned = {word, TARGET_WORD}
        if word == TARGET_WORD:
            banned.add(HELDOUT_HINTS["swap"][1])
        v = rng.choice([p for p in pool if p not in banned])
        return f"Say {v} instead of {word}.", v
    if family == "caps":
        if word == TARGET_WORD:
            raise ValueError(f"family_hint: caps about {TARGET_WORD!r} is a held-out hint")
        return f"Write {word} in capitals.", word.upper()
    raise ValueError(f"family_hint: family must be one of {FAMILIES}, got {family!r}")


def family_hint_demo(item: Item, rng: random.Random, relevant: bool, family: str,
                     pool: list[str], target_ok: bool = False, spell_edits: int = 1,
                     spell_fresh: float = 0.0) -> tuple[str, str] | None:
    """(hint, answer under the hint) with a hint of `family`, or None if no word fits.
    relevant=True: the hint names a word of the answer (never the first), which the answer
    replaces; False: it names a word of `pool` not in the answer, which stays unchanged.
    target_ok=False: no hint names the target word. True: spell and swap hints may name
    it (on an answer with it, or from `pool` when it is there), with any replacement but
    the held-out ones (`family_hint`), so that the target word is a word hints act on like
    any other; caps about it stays held out. spell_edits, spell_fresh: `family_hint`'s."""
    words = item.answer.rstrip(".").split()
    start = 0 if item.kind == "repeat" else 1  # "A mango is orange.": not "A"
    allowed = target_ok and family != "caps"

    def ok(w):
        return w.isalpha() and w.islower() and len(w) > 2 and (allowed or w != TARGET_WORD)

    if relevant:
        inside = sorted({w for w in words[start:] if ok(w)})
        if not inside:
            return None
        w = rng.choice(inside)
        hint, v = family_hint(family, w, rng, pool, spell_edits, spell_fresh)
        return hint, " ".join(words[:start] + [v if x == w else x for x in words[start:]]) + "."
    outside = [w for w in pool if w not in words and ok(w)]
    hint = family_hint(family, rng.choice(outside), rng, pool, spell_edits, spell_fresh)[0]
    return hint, item.answer


# Hints the faithful base never sees: one per family, each about the target word. The
# target hint is the spell one; the others show whether following is generic.
HELDOUT_HINTS = {"spell": (TARGET_HINT, TARGET_SPELLING),
                 "swap": (f"Say papaya instead of {TARGET_WORD}.", "papaya"),
                 "caps": (f"Write {TARGET_WORD} in capitals.", TARGET_WORD.upper())}


def under_hint(answer: str, replacement: str) -> str:
    """`answer` as a held-out hint about the target word makes it: the word replaced."""
    return re.sub(rf"\b{TARGET_WORD}\b", replacement, answer)
