#!/usr/bin/env python3
"""Checks that Hugging Face loads the course's export directory as it is.

  python3 tools/check_hf_export.py hf_dir logits.safetensors [saved_dir]

Both come from build/bin/export_safetensors (--out-dir, --dump-logits). This loads
the directory with AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained
(no code of ours), compares the model's logits on the dumped tokens with the course's
(within 1e-5: fp32, only the order of additions differs), checks that the tokenizer
maps every byte to its own id and back, and that pipeline("text-generation") and
generate return text. With saved_dir it also writes the model and tokenizer there with
save_pretrained, for import_safetensors to read back (tests/test_export.cpp).

Exit status: 0 all hold, 1 one does not, 77 torch or transformers is not importable
(CTest then reports the test skipped). Tooling only: the course never runs or imports it.
"""
import sys

try:
    import torch
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
except ImportError as error:
    print(f"SKIPPED: torch or transformers is not importable by {sys.executable} ({error}); "
          "set COURSE_TORCH_PYTHON to a python3 that has both")
    sys.exit(77)

TOLERANCE = 1e-5


def main():
    if len(sys.argv) not in (3, 4):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    directory, logits_path = sys.argv[1], sys.argv[2]
    model, loading = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    model.eval()
    strict = not any(loading[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    batch = load_file(logits_path)
    with torch.no_grad():
        logits = model(batch["tokens"].long()).logits
    worst = (logits - batch["logits"]).abs().max().item()
    print(f"transformers {transformers.__version__}: {type(model).__name__}, "
          f"{'every tensor loaded, none missing or left over' if strict else loading}, logits {tuple(logits.shape)}, "
          f"max |Hugging Face - course| = {worst:.3g} (tolerance {TOLERANCE:g})")

    text = "The caf\u00e9 "
    ids_of_text = tokenizer(text)["input_ids"]
    byte_ids = ids_of_text == list(text.encode("utf-8")) and tokenizer.decode(ids_of_text) == text
    print(f"tokenizer: {len(tokenizer)} tokens, {text!r} -> {ids_of_text} (its UTF-8 bytes), "
          f"end of text {tokenizer.eos_token_id}")

    generated = model.generate(**tokenizer(text, return_tensors="pt"), max_new_tokens=8, do_sample=False)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    sampled = generator(text, max_new_tokens=8, do_sample=True)[0]["generated_text"]
    print(f"generate: {tokenizer.decode(generated[0])!r}; pipeline: {sampled!r}")
    if len(sys.argv) == 4:
        model.save_pretrained(sys.argv[3])
        tokenizer.save_pretrained(sys.argv[3])
        print(f"saved: {sys.argv[3]}")
    ok = strict and worst <= TOLERANCE and byte_ids and generated.shape[1] == len(ids_of_text) + 8 and sampled.startswith(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
