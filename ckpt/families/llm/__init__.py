"""Language-model architecture facts for llama.cpp GGUFs: one module per llama.cpp architecture
(`archs/`, each an `arch.LLMArch`: the transformers classes it serves, the module paths of one decoder layer,
its tensors' transforms and its model class's converter code), found by `architectures` (`ARCHS`, `EXPORTS`).

These are facts about the architectures, needed in both directions: reading a GGUF back to Hugging Face
names (`ckpt.quant.gguf_llm`) and writing one from them (the HF -> GGUF exporter). They live in the
families package, where model knowledge goes, and in a subpackage because they are no `Family` (tensor
names of one model class, no layouts to tell apart): the family loader looks at the package's own
modules only.

The GGUF names themselves are not listed: gguf's tensor-name tables (`gguf.get_tensor_name_map`) map
each HF module path an architecture lists to llama.cpp's name, as llama.cpp's convert_hf_to_gguf.py does.

Beside them, what an HF LLM folder must hold to be written as a GGUF llama.cpp loads, for every architecture
here: `config_keys` (each config.json key's type, range and the tensor shapes it must agree with) and
`tokenizer_files` (the structure of the tokenizer files and chat templates); `quant_mix` is llama-quantize's
per-tensor type choice.
"""
