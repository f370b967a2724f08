#!/usr/bin/env python3
"""Writes a GGUF file's weights as F32 (dequantized by gguf-py), keeping every metadata key
(tokenizer, chat template, hyper-parameters): the "f32 base" of tests/bench/finetune_bench.sh.
With --bf16, the 2-D weights are rounded to BF16 instead (a bf16 model for the `activations: bf16`
benchmarks in docs/performance.md); 1-D ones (norms) stay F32.

  PY tests/bench/gguf_to_f32.py [--bf16] IN.gguf OUT.gguf   (PY with the `gguf` and numpy packages)
"""
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, GGUFValueType
from gguf.quants import dequantize, quantize


def main():
    args = sys.argv[1:]
    bf16 = "--bf16" in args
    paths = [a for a in args if a != "--bf16"]
    if len(paths) != 2:
        sys.exit("usage: gguf_to_f32.py [--bf16] IN.gguf OUT.gguf")
    src, dst = paths
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
        data = data.reshape(shape)
        if bf16 and len(shape) == 2:
            w.add_tensor(t.name, quantize(data, GGMLQuantizationType.BF16),
                         raw_dtype=GGMLQuantizationType.BF16)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
