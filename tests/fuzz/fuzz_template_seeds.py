#!/usr/bin/env python3
"""Writes seed inputs for fuzz_template: the chat templates of the tokenizers under
shared/tokenizers beside the checkout (or $FUSION_TOKENIZERS) and a few hand-written ones that exercise
macros, loops, namespaces, filters and whitespace control."""
import glob
import hashlib
import json
import os
import sys

HANDWRITTEN = [
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "{%- set ns = namespace(n=0) -%}{%- for m in messages -%}{%- set ns.n = ns.n + 1 -%}"
    "[{{ loop.index }}:{{ m.role|upper }}:{{ m.content|trim }}:{{ m|tojson }}]{%- endfor -%}{{ ns.n }}",
    "{% macro render(v, d=0) %}{% if v is mapping %}{% for k, x in v|dictsort %}{{ k }}={{ render(x, d + 1) }}"
    "{% endfor %}{% elif v is iterable and v is not string %}[{{ v|map('string')|join(',') }}]"
    "{% else %}{{ v }}{% endif %}{% endmacro %}{{ render(tools) }}",
    "{{ bos_token }}{% for m in messages|selectattr('role', 'equalto', 'user') %}{{ m.content[:3] ~ '|' }}"
    "{% else %}none{% endfor %}{% filter upper %}{{ 'x' * 3 }}{% endfilter %}{{ eos_token|default('E') }}",
    "{% set x %}{% raw %}{{ raw }}{% endraw %}{% endset %}{{ x|length }} {{ (1, 2)|list }} {{ {'a': 1}.items()|list }}"
    " {{ '%s-%d'|format('a', 3) }} {{ range(5)|batch(2)|list }} {{ 7 // 2 }} {{ 2 ** 10 }} {{ 'abc'[::-1] }}",
    # literals that fail while they are built, then called
    "{{ {'a': i1tem.s}()|list }} {{ [1, x.y]() }} {{ (1, x.y)() }}",
]


def templates():
    here = os.path.dirname(os.path.abspath(__file__))
    default = os.path.join(here, "..", "..", "..", "shared", "tokenizers")
    root = os.environ.get("FUSION_TOKENIZERS", default)
    for path in sorted(glob.glob(os.path.join(root, "*", "tokenizer_config.json"))):
        try:
            with open(path, encoding="utf-8") as f:
                tpl = json.load(f).get("chat_template")
        except (OSError, ValueError):
            continue
        if isinstance(tpl, str):
            yield tpl
        elif isinstance(tpl, list):
            for item in tpl:
                if isinstance(item, dict) and isinstance(item.get("template"), str):
                    yield item["template"]
    yield from HANDWRITTEN


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for tpl in templates():
        data = tpl.encode("utf-8")
        name = hashlib.sha1(data).hexdigest()
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
