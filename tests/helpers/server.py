"""`jaxkv serve` as a subprocess on a free port, as clients see it."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading

from jaxkv import checkpoint


def start_server(args, timeout=180.0, env=None):
    """Starts `jaxkv serve ARGS --port 0` -> (process, base URL), once it prints its listening line; `env`: extra
    environment variables."""
    proc = subprocess.Popen([sys.executable, "-m", "jaxkv.cli", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=None if env is None else {**os.environ, **env})
    lines, found = [], []

    def read():
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                found.append(m.group(1))
                proc.ready_line = line
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not found:
        proc.kill()
        raise AssertionError(f"the server did not start: {''.join(lines)}{proc.stderr.read()}")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
    return proc, found[0]


TEMPLATE = ("{% for message in messages %}"
            "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
            "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def chat_model_dir(root: pathlib.Path) -> pathlib.Path:
    """The bundled model plus a tokenizer_config.json with a chat template (as a Hugging Face repo ships it)."""
    directory = root / "tiny-chat"
    shutil.copytree(checkpoint.TINY_DIR, directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "chat_template": TEMPLATE}))
    return directory
