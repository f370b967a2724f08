#!/usr/bin/env python3
"""Writes a GGUF file's weights as F32 (dequantized by gguf-py), keeping every metadata key
(tokenizer, chat template, hyper-parameters): the "f32 base" of tests/bench/finetune_bench.sh.

  PY tests/bench/gguf_to_f32.py IN.gguf OUT.gguf      (PY with the `gguf` and numpy packages)
"""
import sys

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGUFValueType
from gguf.quants import dequantize


def main():
    src, dst = sys.argv[1], sys.argv[2]
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        if vtype == GGUFValueType.ARRAY:
            w.add_array(name, f.contents())
        else:
            w.add_key_value(name, f.contents(), vtype)
    for t in r.tensors:
        data = dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = [int(d) for d in reversed(t.shape)]  # GGUF dims are innermost first
        w.add_tensor(t.name, data.reshape(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
