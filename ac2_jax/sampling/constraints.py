"""Grammar-constrained decoding with llguidance: grammars, token masks, replay.

A constraint is an llguidance grammar string (`SamplingParams.constraint`):
what `json_schema_grammar`, `any_json_grammar` and `tool_call_grammar` build,
or any grammar `llguidance.LLMatcher` takes (Lark text or its JSON form).
`GrammarMatcher` follows one output: before each token it gives the allowed
ids (`allowed`, `fill_bitmask`), then `consume`s the sampled one.

The mask at output position i depends only on (grammar, tokenizer,
output_ids[:i]), so the learner rebuilds exactly the masks the sampler
applied with `replay_masks`. The end of a constrained turn is one token,
`end_token_id(tokenizer)` (the tokenizer's EOS, which its chat template
writes after an assistant turn): allowed only where the grammar accepts,
the only allowed id once the grammar is complete. Every other id outside
the grammar (other stop tokens, ids past the tokenizer's vocabulary) is
disallowed.

JSON is constrained to the compact style of Python's `json.dumps` (", ",
": ", no other whitespace), which is how chat templates render tool
arguments; a schema's own "x-guidance" options override it.

llguidance is imported inside the functions that use it (a core dependency,
loaded only when a constraint is used). The llguidance tokenizer of an
`ac2_jax.text.Tokenizer` is built once and cached (`ll_tokenizer`).
"""

from __future__ import annotations

import copy
import json
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "ConstraintError",
    "GrammarMatcher",
    "any_json_grammar",
    "check_grammar",
    "end_token_id",
    "json_schema_grammar",
    "ll_tokenizer",
    "replay_masks",
    "tool_call_grammar",
]

# llguidance JSON options: the separators of json.dumps, no free whitespace.
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

_LLT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LLT_LOCK = threading.Lock()


class ConstraintError(ValueError):
    """A grammar llguidance refuses, or an output the grammar does not allow."""


def _llg():
    import llguidance

    return llguidance


def end_token_id(tokenizer: Any) -> int:
    """The id that ends a constrained turn: the tokenizer's EOS (else its first stop id)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        stops = tuple(getattr(tokenizer, "stop_token_ids", ()) or ())
        if not stops:
            raise ValueError(
                "constrained decoding needs a tokenizer with an EOS token (eos_token_id or "
                "stop_token_ids): the grammar ends the turn with it"
            )
        eos = stops[0]
    return int(eos)


def ll_tokenizer(tokenizer: Any):
    """The `llguidance.LLTokenizer` of an `ac2_jax.text.Tokenizer`, built once.

    Built from the HF `tokenizers.Tokenizer` it wraps (`tokenizer.hf`) with
    `end_token_id(tokenizer)` as its only EOS; cached per tokenizer object.
    """
    hf = getattr(tokenizer, "hf", None)
    if hf is None or not callable(getattr(hf, "to_str", None)):
        raise TypeError(
            "constrained decoding needs an ac2_jax.text.Tokenizer (one that wraps an HF "
            f"`tokenizers.Tokenizer` as .hf), got {type(tokenizer).__name__}"
        )
    with _LLT_LOCK:
        got = _LLT.get(tokenizer)
    if got is not None:
        return got
    hf = copy.copy(hf)
    hf.no_padding()
    hf.no_truncation()
    llt = _llg().LLTokenizer(hf.to_str(), eos_token=end_token_id(tokenizer))
    with _LLT_LOCK:
        return _LLT.setdefault(tokenizer, llt)


# ------------------------------------------------------------------------------ grammars


def _styled(schema: dict) -> dict:
    """`schema` with the JSON_STYLE options (its own "x-guidance" wins)."""
    if not isinstance(schema, dict):
        raise TypeError(f"a JSON schema must be an object (dict), got {type(schema).__name__}")
    own = schema.get("x-guidance", {})
    if not isinstance(own, dict):
        raise TypeError(f'"x-guidance" must be an object, got {own!r}')
    return {**schema, "x-guidance": {**JSON_STYLE, **own}}


def _schema_text(schema: dict, what: str = "the JSON schema") -> str:
    """`_styled(schema)` as JSON text; ValueError naming `what` if it is not JSON."""
    try:
        return json.dumps(_styled(schema), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: not a JSON schema: {e}") from None


def json_schema_grammar(schema: dict) -> str:
    """Grammar of one JSON value valid under `schema` (a JSON-schema dict), in
    the compact `JSON_STYLE`. Not checked here: see `check_grammar`."""
    return _llg().LLMatcher.grammar_from_json_schema(_schema_text(schema))


def any_json_grammar() -> str:
    """Grammar of any JSON object (what response_format json_object asks for)."""
    return json_schema_grammar({"type": "object"})


def _tool_functions(tools: Sequence[dict]) -> list[tuple[str, dict]]:
    """[(name, parameters schema)] of OpenAI tool dicts; ValueError naming a bad one."""
    if isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Sequence) or not tools:
        raise ValueError("tool_call_grammar: tools must be a non-empty list of tool dicts")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(
                f'tool_call_grammar: tools[{i}] is not {{"type": "function", "function": '
                f'{{"name": ..., "parameters": {{...}}}}}}'
            )
        params = fn.get("parameters")
        if params is None:  # no parameters: the function takes none
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict):
            raise ValueError(f"tool_call_grammar: tools[{i}] ({name}) parameters must be an object")
        out.append((name, params))
    return out


def _literal(tokenizer: Any, text: str) -> str:
    """Lark for `text`: a special token (`<[id]>`) when it is one, else a string."""
    ids = tokenizer.encode(text)
    if len(ids) == 1 and ll_tokenizer(tokenizer).is_special_token(ids[0]):
        return f"<[{int(ids[0])}]>"
    return json.dumps(text, ensure_ascii=False)


def tool_call_grammar(
    tokenizer: Any,
    tools: Sequence[dict],
    name: str | None = None,
    *,
    parallel: bool = True,
    or_json: dict | None = None,
) -> str:
    """Grammar of a whole tool-call turn in the tokenizer's tool-call format.

    Hermes (`<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`,
    calls joined by "\\n" as the chat template joins them): NAME one of
    `tools` (only `name` when given) and ARGS valid under that tool's
    JSON-schema `parameters` (JSON_STYLE; no parameters: `{}`). One call, or
    one or more with `parallel`; then the turn ends (`end_token_id`).
    or_json: a JSON schema; the turn may instead be one JSON value valid
    under it (a JSON answer when the model may also call tools).
    ValueError for a format other than Hermes, bad tools or an unknown name.
    """
    parser: Any = getattr(tokenizer, "tool_parser", None)
    if getattr(parser, "name", None) != "hermes":
        raise ValueError(
            "tool_call_grammar supports the 'hermes' tool-call format; this tokenizer's "
            f"is {getattr(parser, 'name', None)!r}"
        )
    fns = _tool_functions(tools)
    if name is not None:
        fns = [(n, p) for n, p in fns if n == name]
        if not fns:
            raise ValueError(f"tool_call_grammar: no tool named {name!r} in tools")
    open_, close = _literal(tokenizer, parser.block_open), _literal(tokenizer, parser.block_close)
    rules = ["start: calls" + (" | answer" if or_json is not None else "")]
    rules.append('calls: call ("\\n" call)*' if parallel else "calls: call")
    if or_json is not None:
        rules.append(f"answer: %json {_schema_text(or_json, 'or_json')}")
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(fns))))
    for i, (fn, params) in enumerate(fns):
        head = parser.named_opening(fn)[len(parser.block_open) :]
        head_lit = json.dumps(head, ensure_ascii=False)
        rules.append(f'call_{i}: {open_} {head_lit} args_{i} "}}\\n" {close}')
        rules.append(f"args_{i}: %json {_schema_text(params, f'{fn} parameters')}")
    return _llg().LLMatcher.grammar_from_lark("\n".join(rules) + "\n")


def check_grammar(grammar: str, tokenizer: Any) -> None:
    """ConstraintError (a ValueError) with llguidance's message if it refuses `grammar`."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise ConstraintError(f"a constraint must be a non-empty grammar string, got {grammar!r}")
    llg = _llg()
    try:
        err = llg.LLMatcher.validate_grammar(grammar, ll_tokenizer(tokenizer))
    except ValueError as e:  # not even parseable as a grammar request
        err = str(e)
    if err:
        raise ConstraintError(f"the grammar was refused: {err.strip()}")


# ------------------------------------------------------------------------------ masks


def unpack_bitmask(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [..., vocab_size] from llguidance bitmask words [..., ceil(V/32)]
    (bit j of word w is id 32 * w + j)."""
    w = np.ascontiguousarray(words, dtype=np.uint32)
    bits = np.unpackbits(w.view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


class GrammarMatcher:
    """One output under a grammar: the allowed ids before each token, then the token.

    vocab_size: the model's vocabulary (default: the tokenizer's); ids past
    the tokenizer's are never allowed. ConstraintError (a ValueError) for a
    grammar llguidance refuses, a token the grammar does not allow, or a
    state that allows no token.
    """

    def __init__(self, grammar: str, tokenizer: Any, vocab_size: int | None = None):
        check_grammar(grammar, tokenizer)
        llt = ll_tokenizer(tokenizer)
        self.grammar = grammar
        self.vocab_size = int(llt.vocab_size if vocab_size is None else vocab_size)
        if self.vocab_size < 1:
            raise ValueError(f"GrammarMatcher: vocab_size must be >= 1, got {vocab_size}")
        self.words = -(-self.vocab_size // 32)
        self._ll_vocab = int(llt.vocab_size)
        self._m = _llg().LLMatcher(llt, grammar, log_level=0)
        self.n_consumed = 0
        self._raise_if_error("building the matcher")

    def _raise_if_error(self, when: str) -> None:
        if self._m.is_error():
            raise ConstraintError(f"grammar error {when}: {self._m.get_error().strip()}")

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Writes the allowed ids of the next token into `out` uint32 [words]."""
        self._raise_if_error(f"at output position {self.n_consumed}")
        got = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint32)
        self._raise_if_error(f"at output position {self.n_consumed}")
        n = min(self.vocab_size, self._ll_vocab)  # ids the tokenizer and the model share
        full, rest = divmod(n, 32)
        out[:] = 0
        out[:full] = got[:full]
        if rest:
            out[full] = got[full] & np.uint32((1 << rest) - 1)
        if not out.any():
            raise ConstraintError(
                f"the grammar allows no token at output position {self.n_consumed} "
                f"(within the model's {self.vocab_size} ids)"
            )

    def allowed(self) -> np.ndarray:
        """bool [vocab_size]: the ids the next token may take."""
        words = np.zeros(self.words, np.uint32)
        self.fill_bitmask(words)
        return unpack_bitmask(words, self.vocab_size)

    def consume(self, token_id: int) -> None:
        """Advances past `token_id`; ConstraintError if the grammar does not allow it."""
        t = int(token_id)
        if not 0 <= t < min(self.vocab_size, self._ll_vocab) or not self._m.consume_token(t):
            err = self._m.get_error().strip().splitlines()
            raise ConstraintError(
                f"token {t} at output position {self.n_consumed} is not allowed by the grammar"
                + (f" ({err[0]})" if err else "")
            )
        self.n_consumed += 1

    def is_accepting(self) -> bool:
        """The output so far is complete under the grammar (the end token is allowed)."""
        return bool(self._m.is_accepting())

    def is_stopped(self) -> bool:
        """Nothing but the end token can follow (or the matcher is in error)."""
        return bool(self._m.is_stopped())


def replay_masks(
    grammar: str,
    tokenizer: Any,
    output_ids: Sequence[int],
    *,
    vocab_size: int | None = None,
    packed: bool = False,
) -> np.ndarray:
    """The allowed ids at each output position: bool [len(output_ids), V], or with
    `packed` the sampler's own bits, uint32 [len(output_ids), ceil(V / 32)]
    (token v: bit v % 32 of word v // 32; 1/8 of the memory: a 4k-token call at
    V = 151,936 is 76 MB packed, 600 MB as bools).

    Row i is the mask the sampler applied before sampling output_ids[i]
    (V = vocab_size, default the tokenizer's; pass the model's). ValueError
    if an output token is outside its mask (not sampled under `grammar`).
    """
    m = GrammarMatcher(grammar, tokenizer, vocab_size)
    words = np.zeros((len(output_ids), m.words), np.uint32)
    for i, t in enumerate(output_ids):
        m.fill_bitmask(words[i])
        m.consume(int(t))
    return words if packed else unpack_bitmask(words, m.vocab_size)
