"""The base install's check (run by scripts/check_base_install.sh in a venv holding only
``spec-grammar[llguidance]`` and ``tokenizers``): no worker/CLI/bench/test dependency is
installed, and a JsonSchema compiled by the llguidance backend on a ``tokenizers.Tokenizer``
built here constrains a draft tree and a whole document exactly as fresh matchers say.

Exits non-zero (an AssertionError) on the first failed check; prints one line per check.
"""

from __future__ import annotations

import importlib.util
import json
import sys

ABSENT = ("transformers", "gguf", "accelerate", "rich", "hypothesis", "matplotlib")


def byte_level_tokenizer():
    """A byte-level BPE ``tokenizers.Tokenizer``: the 256 byte tokens (GPT-2's byte-to-char
    alphabet, ids 0..255) and ``<|endoftext|>`` (id 256, special)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert len(alphabet) == 256
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    return tok


def main() -> None:
    for name in ABSENT:
        assert importlib.util.find_spec(name) is None, f"{name} is installed in the base venv"
    print(f"ok  not installed: {', '.join(ABSENT)}")

    import torch

    import spec_grammar
    from spec_grammar import (
        BackendNotFoundError,
        DraftTree,
        JsonSchema,
        allocate_token_bitmask,
        apply_token_bitmask_inplace,
        get_backend,
        unpack_bitmask,
    )

    assert spec_grammar.__file__.startswith(sys.prefix), spec_grammar.__file__
    print(f"ok  import spec_grammar {spec_grammar.__version__} from {sys.prefix}")

    tok = byte_level_tokenizer()
    eos = tok.token_to_id("<|endoftext|>")
    backend = get_backend("llguidance", tok, stop_token_ids=[eos])
    info = backend.tokenizer_info
    assert (info.vocab_size, info.tokenizer_vocab_size, info.stop_token_ids) == (257, 257, (eos,))
    assert eos in info.special_token_ids
    assert sorted(info.token_bytes[:256]) == [bytes([b]) for b in range(256)]
    assert info.token_bytes[eos] == b"<|endoftext|>"
    print(f"ok  llguidance {backend.library_version()} on a tokenizers.Tokenizer of 257 ids")

    try:
        get_backend("xgrammar", tok, stop_token_ids=[eos])
        raise AssertionError("xgrammar loaded in the base venv")
    except BackendNotFoundError as e:
        assert "pip install 'spec-grammar[xgrammar]'" in str(e), e
    print("ok  xgrammar refused with the install hint")

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    compiled = backend.compile(JsonSchema(schema))
    doc = json.dumps({"name": "Ada", "age": 36})
    ids = tok.encode(doc, add_special_tokens=False).ids
    assert len(ids) == len(doc.encode()) and info.decode(ids) == doc

    def fresh_row(prefix: list[int]) -> torch.Tensor:
        """Oracle: the row of a new matcher after ``prefix``."""
        m = backend.matcher(compiled)
        assert m.accept_tokens(prefix) == len(prefix)
        bm = allocate_token_bitmask(1, backend.vocab_size)
        m.fill_next_token_bitmask(bm, 0)
        return bm[0]

    def allows(row: torch.Tensor, t: int) -> bool:
        return bool((int(row[t >> 5]) >> (t & 31)) & 1)

    # a draft tree: root -> '{' -> '"' and root -> 'x' (refused), '{' -> '}' (refused: required)
    lbrace, quote, x, rbrace = (tok.token_to_id(c) for c in '{"x}')
    tree = DraftTree.from_parents(tokens=[eos, lbrace, quote, x, rbrace], parents=[-1, 0, 1, 0, 1])
    matcher = backend.matcher(compiled)
    bitmask = allocate_token_bitmask(tree.num_nodes, backend.vocab_size)
    valid = matcher.fill_tree_bitmask(tree, bitmask)
    assert valid.tolist() == [True, True, True, False, False], valid.tolist()
    assert matcher.num_accepted == 0
    for node, path in ((0, []), (1, [lbrace]), (2, [lbrace, quote])):
        assert torch.equal(bitmask[node], fresh_row(path)), f"tree row {node}"
    assert not bitmask[3:].any(), "rows of refused nodes must be zero"
    logits = torch.zeros(tree.num_nodes, backend.vocab_size)
    apply_token_bitmask_inplace(logits, bitmask)
    finite = torch.isfinite(logits)
    assert torch.equal(finite, unpack_bitmask(bitmask, backend.vocab_size))
    assert finite[0].nonzero().flatten().tolist() == [lbrace]  # the schema starts with '{'
    print(f"ok  tree fill: valid {valid.tolist()}, rows = fresh matchers', masks applied")

    for k, t in enumerate(ids):
        row = fresh_row(ids[:k])
        bm = allocate_token_bitmask(1, backend.vocab_size)
        matcher.fill_next_token_bitmask(bm, 0)
        assert torch.equal(bm[0], row), f"row after {k} tokens"
        assert allows(row, t) and not allows(row, eos), f"token {k}"
        assert matcher.accept_token(t), f"token {k} refused"
    end = fresh_row(ids)
    assert allows(end, eos) and end.count_nonzero() == 1  # only EOS after the final '}'
    assert matcher.accept_token(eos) and matcher.is_terminated()
    assert matcher.num_accepted == len(ids) + 1
    assert not matcher.accept_token(lbrace)
    matcher.rollback(len(ids) + 1)
    assert not matcher.is_terminated() and matcher.num_accepted == 0
    assert matcher.validate_tokens(ids + [eos]) == len(ids) + 1
    assert matcher.validate_tokens(ids[:-1] + [eos]) == len(ids) - 1
    print(f"ok  accepted {doc} + EOS ({len(ids) + 1} tokens) as fresh matchers allow; terminated")
    print("base install: all checks passed")


if __name__ == "__main__":
    main()
