"""Datasets (JSONL, HF datasets, reasoning-gym), item streams, chat prompts."""

from asyncrl.data.loading import (
    DatasetError,
    held_out,
    load_dataset,
    load_datasets,
    load_hf,
    load_jsonl,
    load_reasoning_gym,
    row_to_item,
)
from asyncrl.data.prompts import build_messages, encode_chat, filter_by_length
from asyncrl.data.stream import ItemStream

__all__ = [
    "DatasetError", "ItemStream", "build_messages", "encode_chat", "filter_by_length", "held_out",
    "load_dataset", "load_datasets", "load_hf", "load_jsonl", "load_reasoning_gym", "row_to_item",
]
