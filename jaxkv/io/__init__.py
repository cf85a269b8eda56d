"""Reading and writing models: Hugging Face checkpoints (`hf.load_hf`: config.json and safetensors through the
family registry), their files (`safetensors_files`: index, shards, headers, dtypes), block-quantized FP8
dequantization (`fp8`), and jaxkv's own directory format (`checkpoint`: `jaxkv.load`, `jaxkv.save`, orbax).

May import jaxkv.config, jaxkv.model, jaxkv.layers and jaxkv.families; nothing below
the entry points imports this package except through `jaxkv.load`. The old paths jaxkv.checkpoint,
jaxkv.checkpoint_hf and jaxkv.checkpoint_fp8 are aliases of checkpoint, hf and fp8.
"""
