"""Cookers and the encoder's hooks called directly (inside an activated Energon WorkerConfig)."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from megatron.energon import SkipSample
from megatron.energon.cache.file_store import SystemFileStore
from mmpack.batch import pack_samples
from mmpack.energon import (
    MEDIA_LOG,
    Conversation,
    PackingEncoderConfig,
    PackingTaskEncoder,
    cook_fragments,
    cook_generic,
)
from mmpack.errors import SampleFormatError
from mmpack_dev.energon_testing import active_worker
from PIL import Image


def png(width: int, height: int, value: int = 7) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), value, dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def raw(key: str, obj: Any, **parts: bytes) -> dict[str, Any]:
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return {
        "__key__": key,
        "__restore_key__": ("test", key),
        "__shard__": "s0",
        "json": body,
        **parts,
    }


def encoder(tokenizer: Any, **changes: Any) -> PackingTaskEncoder:
    cfg = PackingEncoderConfig(**{"capacity": 64, **changes})
    return PackingTaskEncoder(cfg, tokenizer=tokenizer, processor={"patch_size": 16})


WORKED_GENERIC = {
    "messages": [
        {"role": "user", "content": "<image> kaka"},
        {"role": "assistant", "content": "lolo"},
    ],
    "media": [{"name": "img0.png", "kind": "image", "width": 16, "height": 16}],
}
WORKED_FRAGMENTS = {
    "conversation": [
        {
            "role": "user",
            "fragments": [
                {"media": "cat.png", "kind": "image", "width": 16, "height": 16},
                {"text": "kaka", "trainable": False},
            ],
        },
        {"role": "assistant", "fragments": [{"text": "lolo", "trainable": True}]},
    ]
}


@pytest.fixture
def media_store(tmp_path: Path) -> SystemFileStore:
    (tmp_path / "cat.png").write_bytes(png(16, 16))
    (tmp_path / "big.png").write_bytes(png(48, 32))
    return SystemFileStore(tmp_path)


def test_worked_example_gives_the_same_tokens_and_mask_in_both_modes(
    tokenizer: Any, worker: Any, media_store: SystemFileStore
) -> None:
    """2 turns, 1 image, 7 tokens, 3 of them the assistant's: mask [0,0,0,0,1,1,1]."""
    roles = encoder(tokenizer, loss_mask_mode=None)
    pre = encoder(tokenizer, loss_mask_mode="precomputed")
    a = roles.postencode_sample(
        roles.preencode_sample(cook_generic(raw("g", WORKED_GENERIC, **{"img0.png": png(16, 16)})))
    )
    b = pre.postencode_sample(
        pre.preencode_sample(cook_fragments(raw("f", WORKED_FRAGMENTS), media=media_store))
    )
    assert a.num_tokens == b.num_tokens == 7
    assert a.loss_mask is None and b.loss_mask.tolist() == [0, 0, 0, 0, 1, 1, 1]
    pa = roles.build_pack([a])
    pb = pre.build_pack([b])
    assert pa.input_ids.tolist() == pb.input_ids.tolist()
    assert pa.token_mask.tolist() == pb.token_mask.tolist() == [False] * 4 + [True] * 3
    assert pa.loss_mask.tolist() == pb.loss_mask.tolist() == [False] * 3 + [True] * 3 + [False]
    assert pa.labels.tolist() == pb.labels.tolist()
    assert pa.media["pixel_values"].as_tensor().shape == (1, 16 * 16 * 3)


def test_generic_cooker_keeps_media_lazy_and_ignores_unused_entries(
    tokenizer: Any, worker: Any
) -> None:
    obj = {
        "messages": [
            {"role": "user", "content": "<image><image> kaka"},
            {"role": "assistant", "content": "lolo mimi"},
        ],
        "media": [
            {"name": "a.png", "kind": "image", "width": 32, "height": 32},
            {"name": "b.png", "kind": "image"},  # size from the header, no decode
            {"name": "unused.png", "kind": "image", "width": 16, "height": 16},
        ],
    }
    conv = cook_generic(
        raw("g1", obj, **{"a.png": png(32, 32), "b.png": png(48, 16), "unused.png": png(16, 16)})
    )
    MEDIA_LOG.clear()
    enc = encoder(tokenizer, capacity=256)
    encoded = enc.preencode_sample(conv)
    assert MEDIA_LOG.decodes == []
    assert encoded.media_units == 4 + 3
    decoded = enc.postencode_sample(encoded)
    assert MEDIA_LOG.decodes == ["s0/g1/a.png", "s0/g1/b.png"]
    assert [t.shape[0] for t in decoded.decoded_media["pixel_values"].tensors] == [4, 3]


def test_fragments_cooker_reads_the_store_only_when_decoding(
    tokenizer: Any, worker: Any, media_store: SystemFileStore
) -> None:
    obj = {
        "conversation": [
            {
                "role": "user",
                "fragments": [
                    {"media": "big.png"},
                    {"media": "big.png"},
                    {"text": "kaka", "trainable": False},
                ],
            },
            {
                "role": "assistant",
                "fragments": [
                    {"text": "popo", "trainable": False},
                    {"text": "lolo", "trainable": True},
                ],
            },
        ]
    }
    MEDIA_LOG.clear()
    enc = encoder(tokenizer, capacity=256, loss_mask_mode="precomputed")
    conv = cook_fragments(raw("f1", obj), media=media_store)
    assert MEDIA_LOG.reads == []
    encoded = enc.preencode_sample(conv)  # sizes come from the header: no full read
    big = f"{media_store.get_path()}/big.png"
    assert MEDIA_LOG.decodes == [] and MEDIA_LOG.reads == []
    assert MEDIA_LOG.header_reads == [big, big]
    assert 0 < MEDIA_LOG.header_bytes < len(png(48, 32))
    # role/end markers follow the message's fragments; the reasoning fragment is not trained
    assert encoded.loss_mask.tolist()[-4:] == [1, 0, 1, 1]
    decoded = enc.postencode_sample(encoded)
    value = decoded.decoded_media["pixel_values"]
    assert MEDIA_LOG.decodes == [big] and MEDIA_LOG.reads == [big]  # referenced twice, once
    assert len(value.tensors) == 1 and value._segment_indices == [0, 0]


@pytest.mark.parametrize(
    ("obj", "parts", "message"),
    [
        (b"{broken", {}, "not valid JSON"),
        ({"messages": "hi"}, {}, "'messages' must be a list"),
        (
            {"messages": [{"role": "user", "content": "<image>"}], "media": []},
            {},
            "manifest has only 0",
        ),
        (
            {"messages": [{"role": "user", "content": "<image>"}], "media": [{"name": "x.png"}]},
            {},
            "'x.png' from the manifest is not a part",
        ),
        ({"messages": [{"content": "hi"}]}, {}, "needs a string 'role'"),
    ],
)
def test_generic_cooker_errors_name_the_sample(
    obj: Any, parts: dict[str, bytes], message: str
) -> None:
    with pytest.raises(SampleFormatError, match=message) as info:
        cook_generic(raw("bad-sample", obj, **parts))
    assert "bad-sample" in str(info.value)


def test_fragments_without_a_media_store_is_a_clear_error() -> None:
    with pytest.raises(SampleFormatError, match=r"'f2'.*no auxiliary media store named 'media'"):
        cook_fragments(raw("f2", WORKED_FRAGMENTS))


def test_missing_media_key_fails_at_decode_naming_sample_and_key(
    tokenizer: Any, worker: Any, media_store: SystemFileStore
) -> None:
    obj = {
        "conversation": [
            {"role": "user", "fragments": [{"media": "nope.png", "width": 16, "height": 16}]},
            {"role": "assistant", "fragments": [{"text": "lolo", "trainable": True}]},
        ]
    }
    enc = encoder(tokenizer, loss_mask_mode="precomputed")
    encoded = enc.preencode_sample(cook_fragments(raw("f3", obj), media=media_store))
    with pytest.raises(SampleFormatError, match=r"'f3': media key 'nope.png' not found"):
        enc.postencode_sample(encoded)


def test_roles_mode_refuses_fragment_flags_that_contradict_roles(
    tokenizer: Any, worker: Any, media_store: SystemFileStore
) -> None:
    obj = {
        "conversation": [
            {"role": "user", "fragments": [{"text": "kaka", "trainable": True}]},
            {"role": "assistant", "fragments": [{"text": "lolo", "trainable": True}]},
        ]
    }
    with pytest.raises(SampleFormatError, match="loss_mask_mode='precomputed'"):
        encoder(tokenizer).preencode_sample(cook_fragments(raw("f4", obj), media=media_store))


def _conv(turns: list[tuple[str, str]]) -> Conversation:
    return cook_generic(raw("c", {"messages": [{"role": r, "content": c} for r, c in turns]}))


@pytest.mark.parametrize(
    ("turns", "reason"),
    [
        ([("system", "kaka")], "no_turns"),
        ([("user", "kaka"), ("assistant", "lolo"), ("user", "mimi")], "ends_on_user_turn"),
        ([("user", "kaka " * 80), ("assistant", "lolo")], "oversize"),
    ],
)
def test_policy_skips_are_counted_per_reason(
    tokenizer: Any, worker: Any, turns: list[tuple[str, str]], reason: str
) -> None:
    enc = encoder(tokenizer)
    with pytest.raises(SkipSample):
        enc.preencode_sample(_conv(turns))
    stats = enc.stats.snapshot()
    assert stats["skipped"][reason] == 1 and stats["skipped_total"] == 1


def test_empty_trainable_mask_is_skipped(
    tokenizer: Any, worker: Any, media_store: SystemFileStore
) -> None:
    obj = {
        "conversation": [
            {"role": "user", "fragments": [{"text": "kaka", "trainable": False}]},
            {"role": "assistant", "fragments": [{"text": "lolo", "trainable": False}]},
        ]
    }
    enc = encoder(tokenizer, loss_mask_mode="precomputed")
    with pytest.raises(SkipSample):
        enc.preencode_sample(cook_fragments(raw("f5", obj), media=media_store))
    assert enc.stats.snapshot()["skipped"]["empty_trainable_mask"] == 1


def test_oversize_policy_error_names_the_sample(tokenizer: Any, worker: Any) -> None:
    enc = encoder(tokenizer, on_oversize="error")
    with pytest.raises(
        SampleFormatError, match=r"sample 'c' is too long: \d+ tokens > capacity 64"
    ):
        enc.preencode_sample(_conv([("user", "kaka " * 80), ("assistant", "lolo")]))


def test_media_capacity_is_enforced_per_sample_and_per_pack(tokenizer: Any, worker: Any) -> None:
    enc = encoder(tokenizer, capacity=512, media_capacity=6)
    big = {
        "messages": [
            {"role": "user", "content": "<image>"},
            {"role": "assistant", "content": "lolo"},
        ],
        "media": [{"name": "a.png", "width": 48, "height": 48}],
    }
    with pytest.raises(SkipSample):
        enc.preencode_sample(cook_generic(raw("m1", big, **{"a.png": png(48, 48)})))
    assert enc.stats.snapshot()["skipped"]["media_over_budget"] == 1
    small = {
        "messages": [
            {"role": "user", "content": "<image>"},
            {"role": "assistant", "content": "lolo"},
        ],
        "media": [{"name": "a.png", "width": 32, "height": 32}],
    }
    samples = [
        enc.preencode_sample(cook_generic(raw(f"s{i}", small, **{"a.png": png(32, 32)})))
        for i in range(3)
    ]
    groups = enc.select_samples_to_pack(samples)
    assert sorted(len(g) for g in groups) == [1, 1, 1]  # 4 media units each, capacity 6
    assert sorted(s.__key__ for g in groups for s in g) == ["s0", "s1", "s2"]


def test_selection_places_every_sample_exactly_once(tokenizer: Any, worker: Any) -> None:
    enc = encoder(tokenizer, capacity=40, max_items_per_bin=3)
    rng = np.random.default_rng(0)
    samples = [
        enc.preencode_sample(
            _conv([("user", "kaka " * int(rng.integers(1, 20))), ("assistant", "lolo")])
        )
        for _ in range(25)
    ]
    groups = enc.select_samples_to_pack(samples)
    keys = [id(s) for g in groups for s in g]
    assert sorted(keys) == sorted(id(s) for s in samples)
    assert all(len(g) <= 3 and sum(s.num_tokens for s in g) <= 40 for g in groups)


def test_hooks_are_deterministic_for_a_sample_index(tokenizer: Any) -> None:
    enc = encoder(tokenizer)
    conv = _conv([("user", "kaka mimi"), ("assistant", "lolo")])
    with active_worker(sample_index=3):
        a = enc.preencode_sample(conv)
    with active_worker(sample_index=3):
        b = enc.preencode_sample(conv)
    assert a.token_ids.tolist() == b.token_ids.tolist()


def test_pack_samples_native_receives_what_the_encoder_builds(tokenizer: Any, worker: Any) -> None:
    enc = encoder(tokenizer, capacity=128)
    samples = [
        enc.postencode_sample(
            enc.preencode_sample(_conv([("user", "kaka"), ("assistant", "lolo " * i)]))
        )
        for i in (1, 2)
    ]
    direct = pack_samples([enc.to_encoded_sample(s) for s in samples])
    assert direct.input_ids.tolist() == enc.build_pack(samples).input_ids.tolist()


def test_media_is_not_decoded_before_selection_nor_for_skipped_samples(
    tokenizer: Any, worker: Any
) -> None:
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(buf, "PNG")

    def raw(key: str, ending: str) -> dict[str, Any]:
        msgs = [
            {"role": "user", "content": "<image> kaka"},
            {"role": "assistant", "content": "lolo"},
        ]
        if ending == "user":
            msgs.append({"role": "user", "content": "mimi"})
        body = {
            "messages": msgs,
            "media": [
                {"name": "a.png", "width": 32, "height": 32},
                {"name": "b.png", "width": 32, "height": 32},
            ],
        }
        import json

        return {
            "__key__": key,
            "__restore_key__": ("t", key),
            "__shard__": "s",
            "json": json.dumps(body).encode(),
            "a.png": buf.getvalue(),
            "b.png": buf.getvalue(),
        }

    MEDIA_LOG.clear()
    enc = encoder(tokenizer, capacity=512, packing_buffer_size=8, batch_size=2)
    good = enc.preencode_sample(cook_generic(raw("good", "assistant")))
    with pytest.raises(SkipSample):
        enc.preencode_sample(cook_generic(raw("skipped", "user")))
    assert MEDIA_LOG.decodes == [] and MEDIA_LOG.reads == []
    (group,) = enc.select_samples_to_pack([good])
    enc.pack_selected_samples([enc.postencode_sample(s) for s in group])
    assert MEDIA_LOG.decodes == ["s/good/a.png"]  # b.png is in the manifest but never used


TOOL_CALL = {
    "id": "call_0",
    "type": "function",
    "function": {"name": "weather", "arguments": '{"city": "Paris", "days": [1, 2]}'},
}


def test_generic_cooker_hands_every_other_message_key_to_the_template() -> None:
    obj = {
        "messages": [
            {"role": "system", "content": "be brief", "tools": [{"type": "function"}]},
            {"role": "user", "content": "<image> weather?", "name": "ana"},
            {
                "role": "assistant",
                "reasoning_content": "look it up",
                "content": None,
                "tool_calls": [TOOL_CALL],
            },
            {"role": "tool", "tool_call_id": "call_0", "name": "weather", "content": "sunny"},
            # no content at all, only tool calls (the OpenAI shape without the null)
            {"role": "assistant", "tool_calls": [TOOL_CALL], "weight": 0.5, "done": False},
            {"role": "assistant", "content": "", "tool_calls": [], "extra": None},
        ],
        "media": [{"name": "a.png", "width": 16, "height": 16}],
    }
    conv = cook_generic(raw("g-tools", obj, **{"a.png": png(16, 16)}))
    turns = conv.turns
    # every key but role and content, unchanged and in the message's order
    assert [dict(t.fields) for t in turns] == [
        {k: v for k, v in m.items() if k not in ("role", "content")} for m in obj["messages"]
    ]
    assert list(turns[2].fields) == ["reasoning_content", "tool_calls"]
    assert turns[2].fields["tool_calls"] == [TOOL_CALL]
    assert list(turns[3].fields) == ["tool_call_id", "name"]
    # null or missing content is no text: the reply is its tool calls
    assert turns[2].parts == turns[4].parts == turns[5].parts == ()
    assert [p.text for p in turns[3].parts] == ["sunny"]
    assert turns[1].parts[0].media is not None and turns[1].parts[1].text == " weather?"


def test_generic_cooker_without_extra_keys_gives_empty_fields() -> None:
    conv = _conv([("user", "kaka"), ("assistant", "lolo")])
    assert [dict(t.fields) for t in conv.turns] == [{}, {}]


def test_turn_fields_are_read_only_and_turns_stay_hashable_and_picklable() -> None:
    import pickle

    from mmpack.energon.samples import Part, Turn

    obj = {
        "messages": [
            {"role": "user", "content": "kaka"},
            {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL], "n": 1},
        ]
    }
    conv = cook_generic(raw("g-pickle", obj))
    turn = conv.turns[1]
    with pytest.raises(TypeError):
        turn.fields["tool_calls"] = []  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        turn.fields = {}  # type: ignore[misc]
    # Energon pickles samples to its workers
    back = pickle.loads(pickle.dumps(conv))
    assert back.turns == conv.turns
    assert list(back.turns[1].fields) == ["tool_calls", "n"]
    assert hash(back.turns[1]) == hash(turn)
    # equal whatever mapping the fields were given as (1 == 1.0: equal hashes too)
    same = Turn("assistant", (), {"tool_calls": [TOOL_CALL], "n": 1.0})
    assert same == turn and hash(same) == hash(turn)
    assert Turn("user", (Part(text="a"),)) == Turn("user", (Part(text="a"),), {})
    assert len({turn, same, Turn("assistant", ())}) == 2
    # the caller's dict is copied: changing it later changes nothing
    given = {"name": "ana"}
    kept = Turn("user", (), given)
    given["name"] = "bob"
    assert kept.fields == {"name": "ana"}


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"role": "tool"}, ValueError, "'role'"),
        ({"content": "x"}, ValueError, "'content'"),
        ({1: "x"}, TypeError, "keys must be strings"),
        ({"when": object()}, TypeError, r"'when'.*object"),
        ({"calls": [{"args": (1, 2)}]}, TypeError, r"'calls'.*tuple"),
        ({"calls": {1: 2}}, TypeError, r"'calls'.*keys must be strings"),
    ],
)
def test_turn_refuses_fields_that_are_not_json_or_shadow_the_message(
    fields: Any, error: type[Exception], message: str
) -> None:
    from mmpack.energon.samples import Turn

    with pytest.raises(error, match=message):
        Turn("assistant", (), fields)


def test_fragments_cooker_hands_other_turn_keys_to_the_template(
    media_store: SystemFileStore,
) -> None:
    obj = {
        "conversation": [
            {"role": "user", "fragments": [{"text": "weather?", "trainable": False}]},
            {
                "role": "assistant",
                "reasoning_content": "look it up",
                "fragments": [],
                "tool_calls": [TOOL_CALL],
            },
            {
                "role": "tool",
                "tool_call_id": "call_0",
                "fragments": [{"text": "sunny", "trainable": False}],
            },
            {"role": "assistant", "fragments": [{"text": "sunny", "trainable": True}]},
        ]
    }
    conv = cook_fragments(raw("f-tools", obj), media=media_store)
    assert [dict(t.fields) for t in conv.turns] == [
        {},
        {"reasoning_content": "look it up", "tool_calls": [TOOL_CALL]},
        {"tool_call_id": "call_0"},
        {},
    ]
    assert list(conv.turns[1].fields) == ["reasoning_content", "tool_calls"]


@pytest.mark.parametrize("key", ["content", "trainable"])
def test_fragments_cooker_refuses_a_turn_key_mmpack_reads_itself(
    media_store: SystemFileStore, key: str
) -> None:
    obj = {
        "conversation": [
            {"role": "user", "fragments": [{"text": "kaka", "trainable": False}]},
            {"role": "assistant", key: "lolo", "fragments": [{"text": "l", "trainable": True}]},
        ]
    }
    with pytest.raises(SampleFormatError, match=rf"'f-key': turn 1 .*'{key}'"):
        cook_fragments(raw("f-key", obj), media=media_store)


def test_a_text_fragment_without_trainable_is_refused_by_name(
    media_store: SystemFileStore,
) -> None:
    obj = {
        "conversation": [
            {"role": "user", "fragments": [{"text": "kaka", "trainable": False}]},
            {
                "role": "assistant",
                "fragments": [{"text": "lo", "trainable": True}, {"text": "lo"}],
            },
        ]
    }
    with pytest.raises(
        SampleFormatError, match=r"sample 'f-untagged': turn 1, fragment 1: .*'trainable'.*none"
    ):
        cook_fragments(raw("f-untagged", obj), media=media_store)
    obj["conversation"][1]["fragments"][1]["trainable"] = "yes"
    with pytest.raises(
        SampleFormatError, match=r"'f-untagged': turn 1, fragment 1: 'trainable'.*'yes'"
    ):
        cook_fragments(raw("f-untagged", obj), media=media_store)
