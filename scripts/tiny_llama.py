"""A tiny random Llama built locally for the CPU vLLM checks (make test-vllm, make test-fidelity).

Usage: python scripts/tiny_llama.py OUT_DIR (run with the vLLM venv's interpreter).
"""
import sys
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = sys.argv[1]
torch.manual_seed(0)
words = ("the a of to and in is that for it with as was on be by this are from at or an which have "
         "not but they all one were there can more been has if no will their out so up what when about "
         "model token cache block prefill decode engine worker router request prompt batch queue").split()
corpus = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(40)) for i in range(400)]
tok = Tokenizer(models.BPE(unk_token=None))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(corpus, trainers.BpeTrainer(
    vocab_size=2048, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant:{% endif %}")
fast.save_pretrained(out)
cfg = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
                  tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16")
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
print("saved", out)
