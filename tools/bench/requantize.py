"""Re-quantize a GGUF with llama.cpp's quantizer (through llama-cpp-python),
so each kernel family is benchmarked on a real model:

    python tools/bench/requantize.py SmolLM2-135M-Instruct.Q4_1.gguf Q8_0 F16

writes `<stem>.requant-Q8_0.gguf` and `<stem>.requant-F16.gguf` beside the
input. Re-quantizing an already quantized file cannot recover precision; the
point is the weight layout the engines then run, not the model quality.
"""

import ctypes
import pathlib
import sys

import llama_cpp

FTYPES = {
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
}


def main() -> int:
    if len(sys.argv) < 3 or any(t not in FTYPES for t in sys.argv[2:]):
        print(f"usage: {sys.argv[0]} MODEL.gguf TYPE... (TYPE in {', '.join(FTYPES)})", file=sys.stderr)
        return 2
    src = pathlib.Path(sys.argv[1])
    for name in sys.argv[2:]:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FTYPES[name]
        params.allow_requantize = True
        out = src.with_name(f"{src.stem}.requant-{name}.gguf")
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
        if rc != 0:
            print(f"{name}: llama_model_quantize failed ({rc})", file=sys.stderr)
            return 1
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
