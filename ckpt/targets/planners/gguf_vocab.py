"""The tokenizer part of an LLM GGUF: `tokenizer.ggml.*` as llama.cpp's convert_hf_to_gguf.py writes it
(`TextModel._set_vocab_sentencepiece`, `_set_vocab_llama_hf`, `_set_vocab_gpt2` / `get_vocab_base`), from the
tokenizer files beside the weights.

The calls go to an in-memory `gguf.GGUFWriter` (no file: `kv_data` only), the object the reference calls, so key
names, value types and the special-token, merges and chat-template handling are gguf's own (`gguf.SpecialVocab`,
`gguf.LlamaHfVocab`, the installed gguf package). Token lists are read as the reference reads them: SentencePiece
pieces, scores and types through `sentencepiece`, a BPE vocabulary through `transformers.AutoTokenizer` (both
imported here only, lazily: they are the `gguf` extra, `INSTALL`, which only GGUF export needs).

The tokenizer files are input: `check_tokenizer` reads and checks every one of them first
(`ckpt.families.llm.tokenizer_files`), the files this module reads itself are read through
`ckpt.io.small_inputs`, and what the libraries still refuse (a tokenizer.model that is no SentencePiece model, a
merge naming an unknown token) is one line naming the file. The token list written must be one llama.cpp
loads: its tokens unique (llama.cpp asserts it), and as many as the model's embedding rows (the exporter
checks that against the tensor).

`tokenizer.ggml.pre` of a BPE vocabulary names llama.cpp's pre-tokenizer, which it cannot infer: the reference
hashes the token ids of a check text and looks the hash up in a table that `convert_hf_to_gguf_update.py`
generates. `CHECK_TEXT` and `PRE_TOKENIZERS` are that text and table, copied from llama.cpp 0c1e57098 as vendored
in llama-cpp-python 0.3.36 (`conversion/base.py: get_vocab_base_pre`; llama.cpp is MIT licensed, (c) 2023-2025
The ggml authors); where the reference's table has a hash twice, the later entry (the one its chain of `if`s
returns) is kept. A hash not in the table is refused: llama.cpp would not know how to split the text.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from hashlib import sha256
from pathlib import Path

from ckpt import DIST
from ckpt.errors import CkptError
from ckpt.families.llm.tokenizer_files import brief, check_folder, read_json
from ckpt.io.small_inputs import read_small

# What GGUF export needs beyond ckpt's runtime dependencies (pyproject.toml's `gguf` extra: sentencepiece,
# transformers, jinja2): the one place the install hint is spelt, should the distribution be renamed.
INSTALL = f"pip install sentencepiece transformers jinja2 (the {DIST}[gguf] extra)"

CHECK_TEXT = '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, \'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL'
PRE_TOKENIZERS = {
    "b6e8e1518dc4305be2fe39c313ed643381c4da5db34a98f6a04c093f8afbe99b": "chatglm-bpe",  # https://huggingface.co/THUDM/glm-4-9b-chat
    "81d72c7348a9f0ebe86f23298d37debe0a5e71149e29bd283904c02262b27516": "chatglm-bpe",  # https://huggingface.co/THUDM/glm-4-9b-chat
    "a1336059768a55c99a734006ffb02203cd450fed003e9a71886c88acf24fdbc2": "glm4",  # https://huggingface.co/THUDM/glm-4-9b-hf
    "9ca2dd618e8afaf09731a7cf6e2105b373ba6a1821559f258b272fe83e6eb902": "glm4",  # https://huggingface.co/zai-org/GLM-4.5-Air
    "cdf5f35325780597efd76153d4d1c16778f766173908894c04afc20108536267": "glm4",  # https://huggingface.co/zai-org/GLM-4.7-Flash
    "1431a23e583c97432bc230bff598d103ddb5a1f89960c8f1d1051aaa944d0b35": "minerva-7b",  # https://huggingface.co/sapienzanlp/Minerva-7B-base-v1.0
    "7e57df22b1fe23a7b1e1c7f3dc4e3f96d43a4eb0836d0c6bdc3436d7b2f1c664": "hunyuan",  # https://huggingface.co/tencent/Hunyuan-A13B-Instruct
    "bba3b3366b646dbdded5dbc42d59598b849371afc42f7beafa914afaa5b70aa6": "hunyuan-dense",  # https://huggingface.co/tencent/Hunyuan-4B-Instruct
    "e6ddf9c6686791c12d698d34c31ab9be1fea9af5a3d9a6909783ab382198ae1c": "hy_v4",  # https://huggingface.co/tencent/Hy4-preview
    "a6b57017d60e6edb4d88ecc2845188e0eb333a70357e45dcc9b53964a73bbae6": "falcon-h1",  # https://huggingface.co/tiiuae/Falcon-H1-0.5B-Base
    "60476e1243776c4fb1b993dbd7a5f15ac22f83c80afdf425fa5ae01c8d44ef86": "falcon-h1",  # https://huggingface.co/tiiuae/Falcon-H1-1B-Base
    "3eda48b4c4dc7de733d1a8b3e3b4a85243dbbf704da2ee9d42c6beced8897896": "falcon-h1",  # https://huggingface.co/tiiuae/Falcon-H1-7B-Base
    "48f8e02c0359c0bbdd82f26909171fac1c18a457bb47573ed1fe3bbb2c1cfd4b": "falcon-h1",  # https://huggingface.co/tiiuae/Falcon-H1-34B-Base
    "81212dc7cdb7e0c1074ca62c5aeab0d43c9f52b8a737be7b12a777c953027890": "kimi-k2",  # https://huggingface.co/moonshotai/Kimi-K2-Base
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # https://huggingface.co/Qwen/Qwen3-Embedding-0.6B
    "1444df51289cfa8063b96f0e62b1125440111bc79a52003ea14b6eac7016fd5f": "qwen35",  # https://huggingface.co/openbmb/MiniCPM-V-4_6
    "66b8d4e19ab16c3bfd89bce5d785fb7e0155e8648708a1f42077cb9fe002c273": "grok-2",  # https://huggingface.co/alvarobartt/grok-2-tokenizer
    "b3d1dd861f1d4c5c0d2569ce36baf3f90fe8a102db3de50dd71ff860d91be3df": "jina-v2-de",  # https://huggingface.co/aari1995/German_Semantic_V3
    "0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4": "gpt-2",  # https://huggingface.co/evilfreelancer/ruGPT3XL
    "9e454714343b69b99b71795c1d27a68c2a1d15dab111f4d353109f966af29da7": "lfm2",  # https://huggingface.co/LiquidAI/LFM2.5-8B-A1B
    "846deafc5b0fa786186fa4ae6c7b49903cf2f1d1895bdb80b9120d60be135252": "gemma4",  # https://huggingface.co/danish-foundation-models/DFM-Mimir
    "0a766d034107bc736a3f2dc4968fd62e54a3570f1454443e0c5a4cc6bd7941ed": "spark2_5",  # https://huggingface.co/XHToken/Spark-X2.5-1.7B
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # https://huggingface.co/meta-llama/Meta-Llama-3-8B
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",  # https://huggingface.co/deepseek-ai/deepseek-llm-7b-base
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",  # https://huggingface.co/deepseek-ai/deepseek-coder-6.7b-base
    "8aeee3860c56296a157a1fe2fad249ec40aa59b1bb5709f4ade11c4e6fe652ed": "falcon",  # https://huggingface.co/tiiuae/falcon-7b
    "0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f": "jina-v2-en",  # https://huggingface.co/jinaai/jina-embeddings-v2-base-en
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e": "falcon3",  # https://huggingface.co/tiiuae/Falcon3-7B-Base
    "8e62295832751ca1e8f92f2226f403dea30dc5165e448b5bfa05af5340c64ec7": "bert-bge-large",  # https://huggingface.co/BAAI/bge-large-zh-v1.5
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166": "olmo",  # https://huggingface.co/allenai/OLMo-1.7-7B-hf
    "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34": "starcoder",  # https://huggingface.co/bigcode/starcoder2-3b
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # https://huggingface.co/openai-community/gpt2
    "32d85c31273f8019248f2559fed492d929ea28b17e51d81d3bb36fff23ca72b3": "stablelm2",  # https://huggingface.co/stabilityai/stablelm-2-zephyr-1_6b
    "6221ad2852e85ce96f791f476e0b390cf9b474c9e3d1362f53a24a06dc8220ff": "refact",  # https://huggingface.co/smallcloudai/Refact-1_6-base
    "9c2227e4dd922002fb81bde4fc02b0483ca4f12911410dee2255e4987644e3f8": "command-r",  # https://huggingface.co/CohereForAI/c4ai-command-r-v01
    "d772b220ace2baec124bed8cfafce0ead7d6c38a4b65ef11261cf9d5d62246d1": "tiny_aya",  # https://huggingface.co/CohereLabs/tiny-aya-base
    "52df12b4c8d4176e7481aab4b6e8454d1fd0a210a04a574f6d4e067d10e23c3e": "cohere2moe",  # https://huggingface.co/CohereLabs/North-Mini-Code-1.0
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # https://huggingface.co/Qwen/Qwen1.5-7B
    "a8594e3edff7c29c003940395316294b2c623e09894deebbc65f33f1515df79e": "dbrx",  # https://huggingface.co/databricks/dbrx-base
    "c7699093ba4255a91e702aa38a596aa81669f3525dae06c2953267dde580f448": "jina-v1-en",  # https://huggingface.co/jinaai/jina-reranker-v1-tiny-en
    "171aeeedd6fb548d418a7461d053f11b6f1f1fc9b387bd66640d28a4b9f5c643": "jina-v2-es",  # https://huggingface.co/jinaai/jina-embeddings-v2-base-es
    "27949a2493fc4a9f53f5b9b029c82689cfbe5d3a1929bb25e043089e28466de6": "jina-v2-de",  # https://huggingface.co/jinaai/jina-embeddings-v2-base-de
    "a023e9fdc5a11f034d3ef515b92350e56fb2af1f66c6b6811a4444ea9bf8763d": "jina-v5-nano",  # https://huggingface.co/jinaai/jina-embeddings-v5-text-nano
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",  # https://huggingface.co/abacusai/Smaug-Llama-3-70B-Instruct
    "c7ea5862a53e4272c035c8238367063e2b270d51faa48c0f09e9d5b54746c360": "poro-chat",  # https://huggingface.co/LumiOpen/Poro-34B-chat
    "7967bfa498ade6b757b064f31e964dddbb80f8f9a4d68d4ba7998fcf281c531a": "jina-v2-code",  # https://huggingface.co/jinaai/jina-embeddings-v2-base-code
    "7fc505bd3104ca1083b150b17d088b59534ede9bde81f0dd2090967d7fe52cee": "viking",  # https://huggingface.co/LumiOpen/Viking-7B
    "b53802fb28e26d645c3a310b34bfe07da813026ec7c7716883404d5e0f8b1901": "jais",  # https://huggingface.co/core42/jais-13b
    "bc5108ee1eb6a3d600cadd065f63190fbd0554dbc9e4bbd6a0d977970afc8d2a": "jais-2",  # https://huggingface.co/inceptionai/Jais-2-8B-Chat
    "7b3e7548e4308f52a76e8229e4e6cc831195d0d1df43aed21ac6c93da05fec5f": "codeshell",  # https://huggingface.co/WisdomShell/CodeShell-7B
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # https://huggingface.co/mistralai/Mistral-Nemo-Base-2407
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # https://huggingface.co/HuggingFaceTB/SmolLM-135M
    "3c30d3ad1d6b64202cd222813e7736c2db6e1bd6d67197090fc1211fbc612ae7": "bloom",  # https://huggingface.co/bigscience/bloom
    "bc01ce58980e1db43859146dc51b1758b3b88729b217a74792e9f8d43e479d21": "gpt3-finnish",  # https://huggingface.co/TurkuNLP/gpt3-finnish-small
    "4e2b24cc4770243d65a2c9ec19770a72f08cffc161adbb73fcbb6b7dd45a0aae": "exaone",  # https://huggingface.co/LGAI-EXAONE/EXAONE-3.0-7.8B-Instruct
    "fcace8b9cac38ce847670c970cd5892031a753a1ef381abd1d9af00f713da085": "phi-2",  # https://huggingface.co/microsoft/phi-2
    "60824e3c0d9401f89943cbb2fff727f0e2d4c545ba4df2d6e4f09a6db0f5b450": "chameleon",  # https://huggingface.co/facebook/chameleon-7b
    "8b5a93ed704057481f240da0be7e7dca721d7f8f4755263b6807227a2cbeae65": "roberta-bpe",  # https://huggingface.co/sentence-transformers/stsb-roberta-base
    "ad851be1dba641f2e3711822f816db2c265f788b37c63b4e1aeacb9ee92de8eb": "gigachat",  # https://huggingface.co/ai-sage/GigaChat-20B-A3B-instruct
    "d4c8f286ea6b520b3d495c4455483cfa2302c0cfcd4be05d781b6a8a0a7cdaf1": "megrez",  # https://huggingface.co/Infinigence/Megrez-3B-Instruct
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": "deepseek-v3",  # https://huggingface.co/deepseek-ai/DeepSeek-V3
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",  # https://huggingface.co/deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": "gpt-4o",  # https://huggingface.co/Xenova/gpt-4o
    "7dec86086fcc38b66b7bc1575a160ae21cf705be7718b9d5598190d7c12db76f": "superbpe",  # https://huggingface.co/UW/OLMo2-8B-SuperBPE-t180k
    "1994ffd01900cfb37395608534236ecd63f2bd5995d6cb1004dda1af50240f15": "trillion",  # https://huggingface.co/trillionlabs/Trillion-7B-preview
    "96a5f08be6259352137b512d4157e333e21df7edd3fcd152990608735a65b224": "bailingmoe",  # https://huggingface.co/inclusionAI/Ling-lite
    "d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406": "llama4",  # https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E-Instruct
    "0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3": "pixtral",  # https://huggingface.co/mistral-community/pixtral-12b
    "d5f1dd6f980fec569fb218a81a7658ac45fc56b38c5a0adeb1c232fbe04ef5ec": "seed-coder",  # https://huggingface.co/ByteDance-Seed/Seed-Coder-8B-Base
    "b0a6b1c0bd5998ebd9df08611efde34a4ff03faed45ae09c43e6b31ebd4b94cf": "a.x-4.0",  # https://huggingface.co/skt/A.X-4.0
    "f6791d196f87ce6b56a7d234be618e0d58f8cda3549416635b2bebcd22cd95c4": "midm-2.0",  # https://huggingface.co/K-intelligence/Midm-2.0-Base-Instruct
    "169bf0296a13c4d9b7672313f749eb36501d931022de052aad6e36f2bf34dd51": "lfm2",  # https://huggingface.co/LiquidAI/LFM2.5-350M
    "2085e1638f6c377a0aa4ead21b27bb4cb941bf800df86ed391011769c1758dfb": "exaone4",  # https://huggingface.co/LGAI-EXAONE/EXAONE-4.0-32B
    "a1e163ecab2e718a4c829d1148b6e86824ec36163bb71941c3dca9cd5ac25756": "mellum",  # https://huggingface.co/JetBrains/Mellum-4b-base
    "a0b64b4385f123663873756336c085744376d015ff328bb1d901598f63c44152": "modern-bert",  # https://huggingface.co/answerdotai/ModernBERT-base
    "49fc0303c9e0d2c2c565c510f64b2d9b271276acdcdadff733249eda9f7d59df": "afmoe",  # https://huggingface.co/arcee-ai/Trinity-Tokenizer
    "9b1be57e70d20d9501b2b3186e792d81181ae36ada3903c26f9fea418cf87206": "bailingmoe2",  # https://huggingface.co/inclusionAI/Ling-mini-base-2.0
    "53e325976a6e142379c19b09afcae354f2f496f147afa8f9e189a33fe4e3024e": "granite-docling",  # https://huggingface.co/ibm-granite/granite-docling-258M
    "f4f37b6c8eb9ea29b3eac6bb8c8487c5ab7885f8d8022e67edc1c68ce8403e95": "minimax-m2",  # https://huggingface.co/MiniMaxAI/MiniMax-M2
    "4a2e2abae11ca2b86d570fc5b44be4d5eb5e72cc8f22dd136a94b37da83ab665": "kormo",  # https://huggingface.co/KORMo-Team/KORMo-tokenizer
    "9d70134b369a70e5735009b6de918f7581b5211f7c074d1f89f753aea8248af1": "youtu",  # https://huggingface.co/tencent/Youtu-LLM-2B
    "16389f0a1f51ee53e562ffd51c371dc508639ab0e4261502071836e50e223e91": "solar-open",  # https://huggingface.co/upstage/Solar-Open-100B
    "6c81ce329e0802883b22eabab0d3fa48357337ef1ecb45443828bf1f6254833f": "exaone-moe",  # https://huggingface.co/LGAI-EXAONE/K-EXAONE-236B-A23B
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",  # https://huggingface.co/Qwen/Qwen3.5-9B-Instruct
    "b4b8ca1f9769494fbd956ebc4c249de6131fb277a4a3345a7a92c7dd7a55808d": "joyai-llm",  # https://huggingface.co/jdopensource/JoyAI-LLM-Flash
    "e4d54df1ebc1f2b91acd986c5b51aa50837d5faf7c7398e73c1f9e9ee5d19869": "kanana2",  # https://huggingface.co/kakaocorp/kanana-2-30b-a3b-instruct-2601
    "862f827721df956049dff5ca81a57f29e575280bc622e290d3bf4e35eca29015": "f2llmv2",  # https://huggingface.co/codefuse-ai/F2LLM-v2-4B
    "62f6fb0a6fd5098caeabb19b07a5c1099cafc8b9c40eab6ea89ece4ec02fbc57": "sarvam-moe",  # https://huggingface.co/sarvamai/sarvam-30b
    "f728162c1315c26e40249849799b4ba3fe584c32084b4795b03eb295e63cb5af": "talkie",  # https://huggingface.co/lewtun/talkie-1930-13b-it-hf
    "36f3066e97b7f3994b379aaacde306c1444c6ae84e81a5ae3cd2b7ed3b8c42d4": "minicpm5",  # https://huggingface.co/openbmb/MiniCPM5-1B
    "f241072145675bf8322086f115aebad05e9f869557a238bf2150a2a417d1bf60": "granite-embed-multi-97m",  # https://huggingface.co/ibm-granite/granite-embedding-97m-multilingual-r2
    "789696f5946cc0fc59371f39f6097cafed196b3acded6140432f26bbb1ae1669": "granite-embed-multi-311m",  # https://huggingface.co/ibm-granite/granite-embedding-311m-multilingual-r2
    "9dcf830ee9990cdbf78cc523a5f7bd9ad8f3f9890c2d3581d2785ad10f07049d": "mellum2",  # https://huggingface.co/JetBrains/Mellum2-12B-A2.5B-Base
    "972da7b59cec44d1f0a490a86c96df53859e486e481563e5dddac155013d87ac": "laguna",  # https://huggingface.co/poolside/Laguna-XS.2
    "653660222fb704f61cbf2b618a8ae6502b7f8b20c980f9a5de07ed78e13319cd": "ufakzeka",  # https://huggingface.co/ufakai/ufakzeka-1
}


# SentencePiece token types (the reference's SentencePieceTokenTypes, gguf.TokenType's values)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def has_tokenizer(folder: Path) -> bool:
    return _has_spm(folder) or (folder / "tokenizer.json").is_file()


def check_tokenizer(folder: Path) -> None:
    """Refuse, before anything else reads them, tokenizer files the converter's readers would fail on or turn
    into a GGUF llama.cpp does not load (`tokenizer_files.check_folder`), and a model folder without a
    tokenizer: a llama.cpp GGUF carries its vocabulary, and llama.cpp cannot run a file without one."""
    check_folder(folder)
    if not has_tokenizer(folder):
        raise CkptError(f"{folder}: no tokenizer (tokenizer.model or tokenizer.json) beside the weights; a llama.cpp "
                        "GGUF carries the vocabulary: copy the model's tokenizer files into the folder")


@contextmanager
def read_by(path: Path, reader: str):
    """A tokenizer library parsing `path`: what it raises is the file's problem, said in one line naming it (the
    `tokenizers` library raises a bare Exception for a malformed file, sentencepiece a RuntimeError)."""
    try:
        yield
    except CkptError:
        raise
    except Exception as e:  # noqa: BLE001 - any parse failure of the library is this input's
        raise CkptError(f"{path}: {reader} cannot read it ({type(e).__name__}: {brief(str(e))})") from None


def sentencepiece(folder: Path):
    """tokenizer.model as a loaded `SentencePieceProcessor` (read through small_inputs, parsed from memory)."""
    path = folder / "tokenizer.model"
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        raise CkptError(f"{path}: a SentencePiece tokenizer is read with the sentencepiece package, which is not "
                        f"installed: {INSTALL}") from None
    data = read_small(path)
    sp = SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(data)
    except Exception as e:  # noqa: BLE001 - sentencepiece's RuntimeError (or whatever its binding raises)
        why = str(e).strip()  # "INTERNAL: src/x.cc(109) [check that failed] " or a reason ("unk is not defined.")
        why = "its model proto does not parse" if "ParseFromArray" in why else re.sub(r"^[A-Z_]+: ", "", why)
        raise CkptError(f"{path}: not a SentencePiece model ({brief(why)})") from None
    return sp


def _add_tokens(w, tokens: list, source: Path) -> int:
    """`w.add_token_list(tokens)` after checking they are unique: llama.cpp maps each token's text to its id
    and asserts none is lost (llama_vocab::impl::load), so a duplicate makes a GGUF it aborts on."""
    seen: dict[bytes, int] = {}
    for i, t in enumerate(tokens):
        key = t if isinstance(t, bytes) else str(t).encode("utf-8")
        if key in seen:
            raise CkptError(f"{source}: token {brief(repr(t), 40)} is in the vocabulary twice (ids {seen[key]} and "
                            f"{i}); llama.cpp cannot load a GGUF whose tokens are not unique")
        seen[key] = i
    w.add_token_list(tokens)
    return len(tokens)


def pre_tokenizer(tokenizer, folder: Path) -> str:
    """`get_vocab_base_pre`: the name of the pre-tokenizer whose check-text token ids hash as this one's."""
    chkhsh = sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    name = PRE_TOKENIZERS.get(chkhsh)
    if name is None:
        raise CkptError(f"{folder}: BPE pre-tokenizer not recognized (check-text hash {chkhsh}): llama.cpp has no pre-tokenizer "
                        "for this vocabulary (not in convert_hf_to_gguf.py's get_vocab_base_pre table of llama.cpp "
                        "0c1e57098), so it could not tokenize with it")
    return name


def _does_token_look_special(token) -> bool:
    """TextModel.does_token_look_special."""
    text = token.decode("utf-8") if isinstance(token, (bytes, bytearray)) else token
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
            or (text.startswith("<unused") and text.endswith(">")))


def _spm_pieces(sp, vocab_size: int, folder: Path):
    """What both of the reference's SentencePiece readers start from: `vocab_size` slots of `[PADi]` (UNUSED),
    the model's pieces with their scores and kinds, then added_tokens.json (USER_DEFINED)."""
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [UNUSED] * vocab_size
    for i in range(min(sp.vocab_size(), vocab_size)):
        t = NORMAL
        if sp.IsUnknown(i):
            t = UNKNOWN
        elif sp.IsControl(i):
            t = CONTROL
        elif sp.IsUnused(i):
            t = UNUSED
        elif sp.IsByte(i):
            t = BYTE
        tokens[i], scores[i], types[i] = sp.IdToPiece(i).encode("utf-8"), sp.GetScore(i), t
    added = read_json(folder, "added_tokens.json")
    if added is not None:
        for key, i in added.items():
            if i < vocab_size:
                tokens[i], scores[i], types[i] = key.encode("utf-8"), -1000.0, USER_DEFINED
    return tokens, scores, types


def _sentencepiece(folder: Path, hparams: dict):
    """_create_vocab_sentencepiece: (tokens, scores, types)."""
    sp = sentencepiece(folder)
    vocab_size = next((hparams[k] for k in ("vocab_size_per_layer_input", "vocab_size") if k in hparams), None) \
        or sp.vocab_size()
    tokens, scores, types = _spm_pieces(sp, vocab_size, folder)
    config = read_json(folder, "tokenizer_config.json")
    if config is not None:
        for i, data in (config.get("added_tokens_decoder") or {}).items():
            i, token = int(i), data["content"]
            if i >= vocab_size:
                continue
            if data.get("special") or _does_token_look_special(token):
                types[i] = CONTROL
            else:
                token = token.replace("\u2581", " ")  # pre-normalize user-defined spaces
                types[i] = USER_DEFINED
            scores[i], tokens[i] = -1000.0, token.encode("utf-8")
    return tokens, scores, types


class _FirstWins(dict):
    """add_special_token as the reference's gguf-py fills it: a value from the tokenizer.json post-processor is
    not overridden by tokenizer_config.json's `add_*_token` (the post-processor is read first)."""

    def __setitem__(self, key, value):
        if key not in self:
            super().__setitem__(key, value)


def _normalizer_flags(normalizer: dict, out: dict) -> None:
    """The reference gguf-py's SpecialVocab._parse_normalizer."""
    kind = normalizer.get("type")
    if kind == "Lowercase":
        out["lowercase"] = True
    elif kind == "StripAccents":
        out["strip_accents"] = True
    elif kind == "BertNormalizer":
        for k in ("lowercase", "strip_accents"):
            if k in normalizer:
                out[k] = normalizer[k]
    elif kind == "Sequence":
        for n in normalizer.get("normalizers", []):
            _normalizer_flags(n, out)


def add_special_vocab(w, folder: Path, *, tokens: dict[str, int] | None = None, **kw) -> None:
    """`gguf.SpecialVocab(folder, **kw).add_to_gguf(w)` as the reference's own gguf-py (llama.cpp 0c1e57098, newer
    than the gguf 0.19.0 release of the same version number) does it: three rules the release lacks are applied
    here. A ByteLevel post-processor means no BOS/EOS is added (unless a template processor says so); the
    post-processor's add-BOS/EOS wins over tokenizer_config.json's; a Lowercase / StripAccents normalizer is
    recorded (`tokenizer.ggml.normalizer.*`). `tokens`: the special tokens a model class sets itself after
    SpecialVocab has read the files (`_set_special_token`, which keeps a type already read)."""
    import gguf

    class SpecialVocab(gguf.SpecialVocab):
        def _load(self, path):
            self.add_special_token = _FirstWins()
            super()._load(path)
            self.add_special_token = dict(self.add_special_token)

    with read_by(folder, "gguf's SpecialVocab"):
        special = SpecialVocab(folder, **kw)
    flags = {}
    if (tokenizer := read_json(folder, "tokenizer.json")) is not None:
        if post := tokenizer.get("post_processor"):
            if any(p.get("type") == "ByteLevel" for p in post.get("processors", [post])):
                special.add_special_token.setdefault("bos", False)
                special.add_special_token.setdefault("eos", False)
        if normalizer := tokenizer.get("normalizer"):
            _normalizer_flags(normalizer, flags)
    for typ, i in (tokens or {}).items():
        special._set_special_token(typ, i)
    special.add_to_gguf(w, quiet=True)
    for k in ("lowercase", "strip_accents"):
        if k in flags:
            w.add_bool(f"tokenizer.ggml.normalizer.{k}", bool(flags[k]))


def _set_sentencepiece(w, folder: Path, hparams: dict) -> int:
    tokens, scores, types = _sentencepiece(folder, hparams)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    n = _add_tokens(w, tokens, folder / "tokenizer.model")
    w.add_token_scores(scores)
    w.add_token_types(types)
    add_special_vocab(w, folder, n_vocab=len(tokens))
    return n


def _set_llama_hf(w, folder: Path) -> int:
    """_set_vocab_llama_hf: a SentencePiece vocabulary stored as tokenizer.json (raises TypeError otherwise)."""
    import gguf

    path = folder / "tokenizer.json"
    try:
        vocab = gguf.LlamaHfVocab(folder)
    except (FileNotFoundError, TypeError):
        raise  # the reference's signal: not this kind of tokenizer.json (set_vocab goes on to BPE)
    except ImportError:
        raise CkptError(f"{path}: this tokenizer is read through transformers, which is not installed: {INSTALL}") \
            from None
    except Exception as e:  # noqa: BLE001 - transformers' / tokenizers' parse of the file
        raise CkptError(f"{path}: transformers cannot read it ({type(e).__name__}: {brief(str(e))})") from None
    with read_by(path, "gguf's LlamaHfVocab"):
        tokens, scores, types = zip(*vocab.all_tokens()) if vocab.vocab_size else ((), (), ())
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    n = _add_tokens(w, list(tokens), path)
    w.add_token_scores(list(scores))
    w.add_token_types(list(types))
    add_special_vocab(w, folder, n_vocab=len(tokens))
    return n


def _vocab_base(folder: Path, hparams: dict):
    """get_vocab_base: (tokens, types, pre-tokenizer name) of a BPE tokenizer, through transformers."""
    path = folder / "tokenizer.json"
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise CkptError(f"{path}: a BPE tokenizer is read through transformers' AutoTokenizer, as llama.cpp's "
                        f"converter reads it, and transformers is not installed: {INSTALL}") from None
    with read_by(path, "transformers' AutoTokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids = tokenizer.vocab
    vocab_size = hparams.get("vocab_size", len(ids))
    top = max(ids.values(), default=-1)
    if top >= vocab_size:
        token = next(t for t, i in ids.items() if i == top)
        raise CkptError(f"{path}: token {brief(repr(token), 40)} has id {top}, beyond the model's vocab_size "
                        f"{vocab_size}")
    with read_by(path, "transformers' AutoTokenizer"):
        pre = pre_tokenizer(tokenizer, folder)
        reverse = {i: t for t, i in tokenizer.vocab.items()}
        added = tokenizer.get_added_vocab()
        decoder = tokenizer.added_tokens_decoder
        tokens, types = [], []
        for i in range(vocab_size):
            if i not in reverse:
                tokens.append(f"[PAD{i}]")
                types.append(UNUSED)
                continue
            token = reverse[i]
            if token in added:
                if not decoder[i].normalized:
                    token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
                if decoder[i].special or _does_token_look_special(token):
                    types.append(CONTROL)
                else:
                    token = token.replace("\u2581", " ")
                    types.append(USER_DEFINED)
            else:
                types.append(NORMAL)
            tokens.append(token)
    return tokens, types, pre


def _set_gpt2(w, folder: Path, hparams: dict, special: dict[str, int] | None = None) -> int:
    tokens, types, pre = _vocab_base(folder, hparams)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    n = _add_tokens(w, tokens, folder / "tokenizer.json")
    w.add_token_types(types)
    add_special_vocab(w, folder, load_merges=True, tokens=special)
    return n


# TextModel._set_vocab_glm: the special token types it sets from GLM's added tokens (after SpecialVocab's own)
GLM_SPECIAL = (("bos", "[gMASK]"), ("eot", "<|user|>"), ("unk", "<|endoftext|>"), ("eom", "<|observation|>"))


def _glm_special_tokens(folder: Path) -> dict[str, int]:
    """The ids `_set_vocab_glm` looks up among the tokenizer's added tokens (the reference fails with a KeyError
    on a tokenizer without one of them: said here in one line)."""
    path = folder / "tokenizer.json"
    from transformers import AutoTokenizer  # (_vocab_base said how to install it where it is missing)

    with read_by(path, "transformers' AutoTokenizer"):
        added = AutoTokenizer.from_pretrained(folder).get_added_vocab()
    out = {}
    for typ, token in GLM_SPECIAL:
        if token not in added:
            raise CkptError(f"{path}: has no added token {token!r}, which llama.cpp's GLM converter sets as the "
                            f"{typ} token")
        out[typ] = added[token]
    return out


def _phi3_sentencepiece(folder: Path, hparams: dict):
    """Phi3MiniModel.set_vocab's own SentencePiece reading: added tokens from tokenizer_config.json and
    tokenizer.json are USER_DEFINED (CONTROL when special), without the shared reader's normalizations."""
    sp = sentencepiece(folder)
    vocab_size = hparams.get("vocab_size", sp.vocab_size())
    if sp.vocab_size() > vocab_size:
        raise CkptError(f"{folder / 'tokenizer.model'}: {sp.vocab_size()} pieces, more than the model's vocab_size "
                        f"{vocab_size}")
    tokens, scores, types = _spm_pieces(sp, vocab_size, folder)
    entries = []
    if (config := read_json(folder, "tokenizer_config.json")) is not None:
        entries += [(int(i), d, "tokenizer_config.json") for i, d in (config.get("added_tokens_decoder") or {}).items()]
    if (tokenizer := read_json(folder, "tokenizer.json")) is not None:
        entries += [(d["id"], d, "tokenizer.json") for d in tokenizer.get("added_tokens", [])]
    for i, d, name in entries:
        if i >= vocab_size:
            raise CkptError(f"{folder / name}: added token {brief(repr(d['content']), 40)} has id {i}, beyond the "
                            f"model's vocab_size {vocab_size}")
        tokens[i], scores[i] = d["content"].encode("utf-8"), -1000.0
        types[i] = CONTROL if d.get("special") else USER_DEFINED
    return tokens, scores, types


def _has_spm(folder: Path) -> bool:
    """A tokenizer.model is there (anything by that name: `sentencepiece` says what is wrong with it)."""
    path = folder / "tokenizer.model"
    return path.exists() or path.is_symlink()


def _needs_spm(folder: Path, style: str) -> None:
    if not _has_spm(folder):
        raise CkptError(f"{folder}: no tokenizer.model; llama.cpp's converter reads this architecture's vocabulary "
                        f"({style}) from the SentencePiece model")


def vocab_rows(folder: Path, hparams: dict) -> int:
    """Gemma3Model.modify_tensors' n_vocab_real: the tokenizer's size (token_embd rows beyond it are cut)."""
    if _has_spm(folder):
        return len(_sentencepiece(folder, hparams)[0])
    tokenizer = read_json(folder, "tokenizer.json") or {}  # (check_tokenizer saw its model and added_tokens)
    return len(tokenizer["model"]["vocab"]) + len(tokenizer.get("added_tokens", []))


def set_vocab(w, style: str, folder: Path, hparams: dict) -> tuple[int, Path]:
    """The reference's `set_vocab` of the model class `style` names (`LLMArch.vocab`: LlamaModel, Qwen2Model,
    Gemma2Model, Gemma3Model, Phi3MiniModel), called on the writer `w` once `check_tokenizer(folder)` has
    passed; returns the number of tokens written and the file they came from."""
    import gguf

    spm, json_file = folder / "tokenizer.model", folder / "tokenizer.json"
    if style == "gemma3n":  # Gemma3NModel.set_vocab: Gemma 3's over vocab_size (the vision / audio token slots too)
        hparams = {k: v for k, v in hparams.items() if k != "vocab_size_per_layer_input"}
        style = "gemma3"
    if style == "llama":
        config = read_json(folder, "tokenizer_config.json")
        if config is not None and (add_prefix_space := config.get("add_prefix_space")) is not None:
            w.add_add_space_prefix(add_prefix_space)
        if _has_spm(folder):
            out = _set_sentencepiece(w, folder, hparams), spm
        else:
            try:
                out = _set_llama_hf(w, folder), json_file
            except (FileNotFoundError, TypeError):
                out = _set_gpt2(w, folder, hparams), json_file  # Llama 3
        if hparams.get("vocab_size", 32000) == 32016:  # CodeLlama
            with read_by(folder, "gguf's SpecialVocab"):
                special = gguf.SpecialVocab(folder, load_merges=False,
                                            special_token_types=["prefix", "suffix", "middle", "eot"])
            for typ, i in (("prefix", 32007), ("suffix", 32008), ("middle", 32009), ("eot", 32010)):
                special._set_special_token(typ, i)
            special.add_to_gguf(w, quiet=True)
        if hparams.get("vocab_size", 32000) == 49152:  # granite small models
            w.add_add_bos_token(False)
        return out
    if style == "gemma2":
        _needs_spm(folder, "Gemma 2")
        out = _set_sentencepiece(w, folder, hparams), spm
        w.add_add_space_prefix(False)
        return out
    if style == "gemma3" and _has_spm(folder):
        out = _set_sentencepiece(w, folder, hparams), spm
        w.add_add_space_prefix(False)
        return out
    if style == "phi3":
        config = read_json(folder, "tokenizer_config.json")
        if config is not None and config.get("tokenizer_class") == "GPT2Tokenizer":
            return _set_gpt2(w, folder, hparams), json_file  # Phi-4
        _needs_spm(folder, "Phi-3")
        tokens, scores, types = _phi3_sentencepiece(folder, hparams)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        n = _add_tokens(w, tokens, spm)
        w.add_token_scores(scores)
        w.add_token_types(types)
        add_special_vocab(w, folder, n_vocab=len(tokens))
        return n, spm
    if style == "glm":  # TextModel._set_vocab_glm (Glm4MoeModel): BPE, then GLM's own special tokens
        return _set_gpt2(w, folder, hparams, _glm_special_tokens(folder)), json_file
    if style == "qwen2" and _has_spm(folder):  # Qwen2Model.set_vocab
        return _set_sentencepiece(w, folder, hparams), spm
    return _set_gpt2(w, folder, hparams), json_file
