#!/usr/bin/env python3
"""A draft model for speculative decoding made from the model itself: the first --layers
transformer blocks of a llama-family GGUF with its embeddings, final norm, output head and
tokenizer (the same vocabulary, as scheduler.speculative.draft_model requires). Its next-token
guesses are the model's early layers' (layer-skipping self-speculation, as in LayerSkip), so no
second model needs training; how often they are right is what the benchmark measures.

  .venv/bin/python tests/bench/truncate_gguf.py IN.gguf OUT.gguf --layers 8
"""
import argparse
import re

import gguf


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--layers", type=int, required=True)
    args = ap.parse_args()
    reader = gguf.GGUFReader(args.src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    total = reader.fields[f"{arch}.block_count"].contents()
    if not 0 < args.layers < total:
        raise SystemExit(f"--layers must be in [1, {total - 1}] for a model of {total} blocks")
    writer = gguf.GGUFWriter(args.dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer adds these
        value = args.layers if field.name == f"{arch}.block_count" else field.contents()
        if field.name == gguf.Keys.General.NAME:
            value = f"{value} (first {args.layers} of {total} layers)"
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    keep = []
    for t in reader.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m is None or int(m.group(1)) < args.layers:
            keep.append(t)
    for t in keep:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in keep:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    print(f"{args.dst}: {len(keep)} tensors, {args.layers} of {total} blocks")


if __name__ == "__main__":
    main()
