"""Cookers for the two source formats. Both are lazy: media stays a `MediaHandle`.

* generic (subflavor ``mmpack_format: generic``): one WebDataset sample holds ``<key>.json`` with
  ``messages[]`` (``role``, ``content`` with ``<image>`` / ``<video>`` / ``<audio>`` placeholders;
  a null or missing ``content`` is no text, as beside OpenAI ``tool_calls``) and a media manifest
  ``media[]`` (``name``, ``kind``, ``width``/``height`` (and ``frames``) or ``duration``), plus
  one part per media item (``<key>.<name>``). Placeholders take manifest entries in order;
  entries no placeholder takes are never read or decoded.
* fragments (subflavor ``mmpack_format: fragments``): ``<key>.json`` with
  ``conversation[].fragments[]``; a fragment is ``{"text": ..., "trainable": bool}`` (the flag
  is required) or ``{"media": KEY, "kind": ..., ...metadata}``, and KEY is looked up in a
  separate media store, the metadataset's auxiliary dataset ``media`` (e.g. ``aux: {media:
  filesystem://media}``).

Every other key of a message (generic) or turn (fragments), such as ``tool_calls``,
``tool_call_id``, ``name`` or ``reasoning_content``, is kept as the turn's `Turn.fields`, in
order and unchanged, for the chat template. A fragments turn may not have ``content`` (its text
is its fragments) nor ``trainable`` (a flag of each text fragment).

Media sources (see `mmpack.energon.media` for the identity rule): a generic item is named by
its dataset's path (from the sample's Energon source info), shard, sample key and member; a
fragments item by its media store's path and key.

Cookers must be `@stateless` (Energon re-runs them on restore) and need the task encoder's
``decoder = None`` (raw bytes: decoding is ours, and lazy).
"""

from __future__ import annotations

import json
import re
from typing import Any

from megatron.energon import Cooker, basic_sample_keys, stateless

from mmpack.energon.media import MediaHandle, store_path, store_source, webdataset_source
from mmpack.energon.samples import Conversation, Part, Turn
from mmpack.errors import SampleFormatError

__all__ = ["FRAGMENTS", "GENERIC", "cook_fragments", "cook_generic", "default_cookers"]

GENERIC = "generic"
FRAGMENTS = "fragments"
FORMAT_SUBFLAVOR = "mmpack_format"
PLACEHOLDERS = {"<image>": "image", "<audio>": "audio", "<video>": "video"}
#: keys of a generic message that make its turn's role and parts; the others are its fields
_GENERIC_KEYS = frozenset({"role", "content"})
#: keys of a fragments turn that make its role and parts; the others are its fields
_FRAGMENTS_KEYS = frozenset({"role", "fragments"})
#: keys a fragments turn may not have, and why: as fields they would pass for mmpack's own
_FRAGMENTS_REFUSED = {
    "content": "its text is its fragments, and a 'content' field would replace that text in "
    "the message the chat template renders",
    "trainable": "'trainable' is a flag of each text fragment; on the turn it would train "
    "nothing differently",
}
_PLACEHOLDER_RE = re.compile("(" + "|".join(re.escape(p) for p in PLACEHOLDERS) + ")")


def _load_json(raw: dict[str, Any]) -> dict[str, Any]:
    key = raw.get("__key__", "?")
    data = raw.get("json")
    if data is None:
        raise SampleFormatError(f"sample {key!r}: no 'json' part (parts: {_parts(raw)})")
    try:
        obj = json.loads(data)
    except (ValueError, TypeError, RecursionError) as err:
        raise SampleFormatError(
            f"sample {key!r}: the 'json' part is not valid JSON ({err})"
        ) from err
    if not isinstance(obj, dict):
        raise SampleFormatError(f"sample {key!r}: the 'json' part must be an object")
    return obj


def _dataset_path(raw: dict[str, Any]) -> str:
    """The path of the dataset the raw sample was read from (Energon's source info; empty for
    a sample built by hand, which has none)."""
    for info in raw.get("__sources__") or ():
        path = getattr(info, "dataset_path", None)
        if path is not None:
            return str(path)
    return ""


def _tools(key: str, obj: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The sample's top-level ``tools`` (tool schemas for the template), or None."""
    tools = obj.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise SampleFormatError(f"sample {key!r}: 'tools' must be a list of tool schemas")
    return tools


def _turn(key: str, index: int, role: str, parts: list[Part], fields: Any) -> Turn:
    try:
        return Turn(role=role, parts=tuple(parts), fields=fields)
    except RecursionError as err:
        raise SampleFormatError(f"sample {key!r}: message {index} is nested too deeply") from err


def _parts(raw: dict[str, Any]) -> list[str]:
    return sorted(k for k in raw if not k.startswith("__"))


@stateless
def cook_generic(raw: dict[str, Any], **_aux: Any) -> Conversation:
    """``messages[]`` + media manifest in one WebDataset sample -> `Conversation`."""
    key = str(raw.get("__key__", "?"))
    obj = _load_json(raw)
    messages = obj.get("messages")
    if not isinstance(messages, list):
        raise SampleFormatError(f"sample {key!r}: 'messages' must be a list")
    manifest = obj.get("media", [])
    if not isinstance(manifest, list):
        raise SampleFormatError(f"sample {key!r}: 'media' must be a list")
    shard = str(raw.get("__shard__", ""))
    dataset = _dataset_path(raw)
    next_media = 0
    turns = []
    for m_idx, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise SampleFormatError(f"sample {key!r}: message {m_idx} needs a string 'role'")
        content = message.get("content")
        if content is None:
            content = ""  # an assistant turn of only tool calls has null (or no) content
        elif not isinstance(content, str):
            raise SampleFormatError(f"sample {key!r}: message {m_idx} 'content' must be a string")
        parts: list[Part] = []
        for piece in _PLACEHOLDER_RE.split(content):
            if not piece:
                continue
            kind = PLACEHOLDERS.get(piece)
            if kind is None:
                parts.append(Part(text=piece))
                continue
            if next_media >= len(manifest):
                raise SampleFormatError(
                    f"sample {key!r}: message {m_idx} has a {piece} placeholder but the media "
                    f"manifest has only {len(manifest)} entries"
                )
            entry = manifest[next_media]
            next_media += 1
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise SampleFormatError(
                    f"sample {key!r}: media entry {next_media - 1} needs a 'name'"
                )
            if entry.get("kind", kind) != kind:
                raise SampleFormatError(
                    f"sample {key!r}: placeholder {piece} refers to media entry "
                    f"{entry['name']!r} of kind {entry.get('kind')!r}"
                )
            name = entry["name"]
            data = raw.get(name)
            if not isinstance(data, (bytes, bytearray)):
                raise SampleFormatError(
                    f"sample {key!r}: media {name!r} from the manifest is not a part of the sample "
                    f"(parts: {_parts(raw)})"
                )
            parts.append(
                Part(
                    media=MediaHandle(
                        kind=kind,
                        key=name,
                        source=webdataset_source(dataset, shard, key, name),
                        sample_key=key,
                        data=bytes(data),
                        meta=entry,
                    )
                )
            )
        fields = {k: v for k, v in message.items() if k not in _GENERIC_KEYS}
        turns.append(_turn(key, m_idx, message["role"], parts, fields))
    return Conversation(
        **basic_sample_keys(raw), source_format=GENERIC, turns=turns, tools=_tools(key, obj)
    )


@stateless
def cook_fragments(raw: dict[str, Any], *, media: Any = None, **_aux: Any) -> Conversation:
    """``conversation[].fragments[]`` with per-fragment ``trainable`` and media keys into the
    auxiliary media store ``media`` -> `Conversation`."""
    key = str(raw.get("__key__", "?"))
    obj = _load_json(raw)
    conversation = obj.get("conversation")
    if not isinstance(conversation, list):
        raise SampleFormatError(f"sample {key!r}: 'conversation' must be a list")
    turns = []
    store: str | None = None  # the media store's path, asked for at the first media fragment
    for t_idx, turn in enumerate(conversation):
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str):
            raise SampleFormatError(f"sample {key!r}: turn {t_idx} needs a string 'role'")
        fragments = turn.get("fragments")
        if not isinstance(fragments, list):
            raise SampleFormatError(f"sample {key!r}: turn {t_idx} needs a 'fragments' list")
        for name, why in _FRAGMENTS_REFUSED.items():
            if name in turn:
                raise SampleFormatError(
                    f"sample {key!r}: turn {t_idx} ({turn['role']}) has a {name!r} key: {why}"
                )
        parts: list[Part] = []
        for f_idx, frag in enumerate(fragments):
            if not isinstance(frag, dict):
                raise SampleFormatError(
                    f"sample {key!r}: fragment {t_idx}.{f_idx} is not an object"
                )
            if "media" in frag:
                mkey = frag["media"]
                if not isinstance(mkey, str):
                    raise SampleFormatError(
                        f"sample {key!r}: fragment {t_idx}.{f_idx} media key must be a string"
                    )
                if media is None:
                    raise SampleFormatError(
                        f"sample {key!r}: fragment {t_idx}.{f_idx} references media {mkey!r} but "
                        "the dataset has no auxiliary media store named 'media' (add "
                        "`aux: {media: ...}` to the metadataset entry)"
                    )
                kind = frag.get("kind", "image")
                if not isinstance(kind, str):
                    raise SampleFormatError(
                        f"sample {key!r}: fragment {t_idx}.{f_idx} media kind must be a string"
                    )
                if store is None:
                    try:
                        store = store_path(media)
                    except SampleFormatError as err:
                        raise SampleFormatError(f"sample {key!r}: {err}") from err
                parts.append(
                    Part(
                        media=MediaHandle(
                            kind=kind,
                            key=mkey,
                            source=store_source(store, mkey),
                            sample_key=key,
                            store=media,
                            meta=frag,
                        )
                    )
                )
            else:
                text = frag.get("text")
                where = f"sample {key!r}: turn {t_idx}, fragment {f_idx}"
                if not isinstance(text, str):
                    raise SampleFormatError(f"{where}: a text fragment needs 'text' (a string)")
                # required: text the writer forgot to flag must not drop out of training unseen
                if "trainable" not in frag:
                    raise SampleFormatError(
                        f"{where}: a text fragment needs its 'trainable' flag (true or false); "
                        "it has none"
                    )
                trainable = frag["trainable"]
                if not isinstance(trainable, bool):
                    raise SampleFormatError(
                        f"{where}: 'trainable' must be true or false, not {trainable!r}"
                    )
                parts.append(Part(text=text, trainable=trainable))
        fields = {k: v for k, v in turn.items() if k not in _FRAGMENTS_KEYS}
        turns.append(_turn(key, t_idx, turn["role"], parts, fields))
    return Conversation(
        **basic_sample_keys(raw), source_format=FRAGMENTS, turns=turns, tools=_tools(key, obj)
    )


def default_cookers() -> list[Cooker]:
    """Cookers selected by the ``mmpack_format`` subflavor (``generic`` when absent)."""
    return [
        Cooker(cook_fragments, has_subflavors={FORMAT_SUBFLAVOR: FRAGMENTS}),
        Cooker(cook_generic),
    ]
