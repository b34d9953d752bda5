"""`mistral3` (Mistral3Model in the reference's conversion/mistral3.py): the language model of a Mistral 3 /
Ministral 3 vision-language folder (`Mistral3ForConditionalGeneration`), and a text-only `Ministral3ForCausalLM`.

The reference hands such a folder to `Ministral3Model`, a `LlamaModel` under the `mistral3` architecture: the
language model's tensors (under `language_model.`; the Pixtral vision tower and the projector left out,
`ckpt.families.llm.multimodal`) with q/k rows permuted for llama.cpp's RoPE, LlamaModel's parameters and
vocabulary, and for a `ministral3` text config the YaRN log multiplier and Llama 4 attention temperature scale
it adds. A `mistral4` text config (an MLA mixture of experts the reference converts as DeepSeek-V2) is refused.
Read back as the causal LM of its text config (`MistralForCausalLM`, `Ministral3ForCausalLM`)."""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.families.llm.arch import LLAMA_LAYER, Export, Readback
from ckpt.families.llm.archs.llama import Llama
from ckpt.families.llm.multimodal import text_model_name


class Mistral3(Llama):
    def source_name(self, name: str) -> str | None:
        """TextModel.filter_tensors: the language model's tensors under their causal LM names, nothing else."""
        return text_model_name(name)

    def check(self, x: Export, hf_arch: str) -> None:
        model_type = x.hparams.get("model_type")
        if model_type == "mistral4":
            raise CkptError(f"{x.config_path}: {hf_arch} with a mistral4 text model (multi-head latent attention and "
                            "experts, converted as DeepSeek-V2 by llama.cpp) is not a variant ckpt writes; use "
                            "llama.cpp's convert_hf_to_gguf.py")
        if model_type == "ministral3":  # Ministral3Model.set_gguf_parameters asserts these
            rope = x.rope
            if rope.get("rope_type") != "yarn":
                raise CkptError(f"{x.config_path}: a ministral3 text model has rope_type "
                                f"{str(rope.get('rope_type'))[:40]!r}, not the 'yarn' llama.cpp's converter requires")
            for key in ("mscale_all_dim", "llama_4_scaling_beta"):
                v = rope.get(key)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) > 3.4e38:
                    raise CkptError(f"{x.config_path}: a ministral3 text model's rope_parameters.{key} is "
                                    f"{str(v)[:40]}, not the number llama.cpp's converter writes")
        super().check(x, hf_arch)

    def parameters(self, w, x: Export, ftype: int) -> list[str]:
        """Ministral3Model.set_gguf_parameters: LlamaModel's, then for ministral3 the YaRN log multiplier
        (`mscale_all_dim`) and the attention temperature scale (`llama_4_scaling_beta`)."""
        notes = super().parameters(w, x, ftype)
        if x.hparams.get("model_type") == "ministral3":
            w.add_rope_scaling_yarn_log_mul(x.rope["mscale_all_dim"])
            w.add_attn_temperature_scale(x.rope["llama_4_scaling_beta"])
        return notes

    def read_config(self, r: Readback) -> None:
        """The text config's causal LM: Ministral 3 where the GGUF has its attention temperature scale (its YaRN
        RoPE parameters from the metadata), else Mistral (no sliding window: llama.cpp's mistral3 has none)."""
        from ckpt.quant.gguf_llm import Meta

        import gguf

        m = Meta(r.header, self.arch)
        K = gguf.Keys
        beta = r.header.value(m.key(K.Attention.TEMPERATURE_SCALE))
        if beta is None:
            r.cfg["sliding_window"] = None
            return
        rope = r.cfg.pop("rope_scaling", None) or {}
        rope_theta = r.cfg.pop("rope_theta")
        r.cfg.update(architectures=["Ministral3ForCausalLM"], model_type="ministral3")
        if rope.get("rope_type") != "yarn" or "original_max_position_embeddings" not in rope:
            raise CkptError(f"{r.path}: a mistral3 GGUF with an attention temperature scale (Ministral 3) has RoPE "
                            f"scaling {str(rope.get('rope_type'))[:40]!r}, not yarn with its original context length; "
                            "nothing was written")
        params = {"rope_type": "yarn", "rope_theta": rope_theta, "factor": rope["factor"],
                  "original_max_position_embeddings": rope["original_max_position_embeddings"],
                  "max_position_embeddings": r.cfg["max_position_embeddings"],
                  "beta_fast": m.number(K.Rope.SCALING_YARN_BETA_FAST, 32.0),
                  "beta_slow": m.number(K.Rope.SCALING_YARN_BETA_SLOW, 1.0),
                  "mscale_all_dim": m.number(K.Rope.SCALING_YARN_LOG_MUL, 1.0),
                  "mscale": 1.0, "llama_4_scaling_beta": m.number(K.Attention.TEMPERATURE_SCALE)}
        r.cfg.update(rope_parameters=params, sliding_window=None)
        r.notes[:] = [note for note in r.notes if not note.startswith("config.json rope_scaling")]
        r.notes.append("config.json rope_parameters: Ministral 3's YaRN from the GGUF metadata (mscale 1.0, as "
                       "llama.cpp assumes)")


ARCH = Mistral3("mistral3", "MistralForCausalLM", "mistral", LLAMA_LAYER, rope_permute=True,
                hf_classes=("Mistral3ForConditionalGeneration", "Ministral3ForCausalLM"), llama_params=True,
                vocab="llama")
