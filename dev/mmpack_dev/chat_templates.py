# ruff: noqa: E501
# (the templates are the released text, long lines included)
"""Released chat templates of six model families, each with a copy that marks the assistant's output
in ``{% generation %}`` blocks, and Qwen2's real tokenizer set up for each family.

Every ``<FAMILY>_TEMPLATE`` is the text the model's ``tokenizer_config.json`` ships. Every
``<FAMILY>_GENERATION_TEMPLATE`` is derived from it by a few exact substitutions: the assistant's
content, reasoning, tool calls and end-of-turn token (not its role header, not the newline after the
end-of-turn token) sit inside ``{% generation %}...{% endgeneration %}``, so that
``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks them, and the copy renders
the same text as the release for every conversation.

``family_tokenizer(family, generation)`` is Qwen2's real BPE vocabulary (``qwen_vocab``) with the
family's template and its control tokens added as single tokens. The conversations these templates
accept are drawn by ``mmpack_dev.chat_conversations``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from mmpack_dev.qwen_vocab import (
    QWEN2_VL_CHAT_TEMPLATE,
    QWEN2_VL_GENERATION_TEMPLATE,
    QWEN2_VL_SPECIAL_TOKENS,
    qwen2_vl_tokenizer,
)


def _marked(template: str, *edits: tuple[str, str, int]) -> str:
    """`template` with each `(old, new, count)` substitution made; `old` must occur `count` times."""
    for old, new, count in edits:
        found = template.count(old)
        if found != count:
            raise RuntimeError(f"expected {count} occurrence(s) of {old[:60]!r}, found {found}")
        template = template.replace(old, new)
    if "{%- generation" not in template and "{% generation" not in template:
        raise RuntimeError("the generation markers were not placed")
    return template


# Qwen2-VL-Instruct (kept in qwen_vocab, named here like the other families)
QWEN2_VL_TEMPLATE = QWEN2_VL_CHAT_TEMPLATE

# Qwen2.5-Instruct (Qwen/Qwen2.5-7B-Instruct, tokenizer_config.json; the same in every size)
QWEN2_5_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
# The plain assistant turn gets its own branch; in the tool-call turn the newline after the header
# moves to just before the content or first call. Each prints its header, then one block.
QWEN2_5_GENERATION_TEMPLATE = _marked(
    QWEN2_5_TEMPLATE,
    (' or (message.role == "assistant" and not message.tool_calls) %}', " %}", 1),
    (
        "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n",
        "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
        '    {%- elif message.role == "assistant" and not message.tool_calls %}\n'
        "        {{- '<|im_start|>' + message.role + '\\n' }}\n"
        "        {%- generation %}{{- message.content + '<|im_end|>' }}{%- endgeneration %}\n"
        "        {{- '\\n' }}\n",
        1,
    ),
    (
        "        {{- '<|im_start|>' + message.role }}\n        {%- if message.content %}\n"
        "            {{- '\\n' + message.content }}\n",
        "        {{- '<|im_start|>' + message.role + '\\n' }}\n        {%- generation %}\n"
        "        {%- if message.content %}\n            {{- message.content }}\n",
        1,
    ),
    (
        """            {{- '\\n<tool_call>\\n{"name": "' }}\n""",
        "            {%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}\n"
        """            {{- '<tool_call>\\n{"name": "' }}\n""",
        1,
    ),
    (
        "        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n",
        "        {%- endfor %}\n        {{- '<|im_end|>' }}\n        {%- endgeneration %}\n"
        "        {{- '\\n' }}\n",
        1,
    ),
)

# Qwen3 (Qwen/Qwen3-0.6B and Qwen/Qwen3-8B, tokenizer_config.json, the revision that reads
# `message.content is string` and `message.reasoning_content is string`)
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""
# The header leaves the three branches that print it; one block holds the think block, content, tool
# calls and <|im_end|>
QWEN3_GENERATION_TEMPLATE = _marked(
    QWEN3_TEMPLATE,
    (
        "        {%- if loop.index0 > ns.last_query_index %}\n",
        "        {{- '<|im_start|>' + message.role + '\\n' }}\n"
        "        {%- generation %}\n"
        "        {%- if loop.index0 > ns.last_query_index %}\n",
        1,
    ),
    (r"{{- '<|im_start|>' + message.role + '\n<think>\n' + ", r"{{- '<think>\n' + ", 1),
    (r"{{- '<|im_start|>' + message.role + '\n' + content }}", "{{- content }}", 2),
    (
        r"""        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
""",
        r"""        {%- endif %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- elif message.role == "tool" %}
""",
        1,
    ),
)

# Llama 3.1 Instruct (meta-llama/Llama-3.1-8B-Instruct, tokenizer_config.json; Llama-3.3-70B-Instruct
# ships the same text). Its date line is the fixed "26 Jul 2024" unless `date_string` is passed.
LLAMA3_1_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""
_LLAMA_PLAIN = (
    "not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message)"
)
_LLAMA_HEADER = r"{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}"
# An assistant message without tool calls gets its own branch; the tool-call branch prints the header
# once, before one block that holds both call forms and the <|eom_id|>/<|eot_id|> that ends them
LLAMA3_1_GENERATION_TEMPLATE = _marked(
    LLAMA3_1_TEMPLATE,
    (
        "    {%- if " + _LLAMA_PLAIN + " %}\n",
        "    {%- if " + _LLAMA_PLAIN + " and message['role'] == 'assistant' %}\n"
        "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
        "        {%- generation %}\n"
        "            {{- message['content'] | trim + '<|eot_id|>' }}\n"
        "        {%- endgeneration %}\n"
        "    {%- elif " + _LLAMA_PLAIN + " %}\n",
        1,
    ),
    ("            " + _LLAMA_HEADER + "\n", "", 2),
    (
        "        {%- set tool_call = message.tool_calls[0].function %}\n",
        "        {%- set tool_call = message.tool_calls[0].function %}\n"
        "        " + _LLAMA_HEADER + "\n"
        "        {%- generation %}\n",
        1,
    ),
    (
        '            {{- "<|eot_id|>" }}\n        {%- endif %}\n',
        '            {{- "<|eot_id|>" }}\n        {%- endif %}\n        {%- endgeneration %}\n',
        1,
    ),
)

# Gemma 3 instruction-tuned (google/gemma-3-4b-it, tokenizer_config.json; the same in every size)
GEMMA3_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
_GEMMA_BODY = GEMMA3_TEMPLATE[
    GEMMA3_TEMPLATE.index("    {%- if message['content'] is string -%}\n") : GEMMA3_TEMPLATE.index(
        "    {{ '<end_of_turn>\\n' }}\n"
    )
]
# A model turn renders its content and <end_of_turn> in a block, the newline after it outside
GEMMA3_GENERATION_TEMPLATE = _marked(
    GEMMA3_TEMPLATE,
    (
        _GEMMA_BODY + "    {{ '<end_of_turn>\\n' }}\n",
        "    {%- if role == 'model' -%}\n"
        "    {%- generation -%}\n" + _GEMMA_BODY + "    {{ '<end_of_turn>' }}\n"
        "    {%- endgeneration -%}\n"
        "    {{ '\\n' }}\n"
        "    {%- else -%}\n" + _GEMMA_BODY + "    {{ '<end_of_turn>\\n' }}\n"
        "    {%- endif -%}\n",
        1,
    ),
)

# OLMo 2 Instruct (allenai/OLMo-2-1124-7B-Instruct, tokenizer_config.json): Tulu 3's template with
# the bos token first; an assistant turn ends with eos_token, and with '\n' after it when not last
OLMO2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<|system|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'assistant' %}"
    "{% if not loop.last %}{{ '<|assistant|>\\n'  + message['content'] + eos_token + '\\n' }}"
    "{% else %}{{ '<|assistant|>\\n'  + message['content'] + eos_token }}{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}{% endfor %}"
)
OLMO2_GENERATION_TEMPLATE = _marked(
    OLMO2_TEMPLATE,
    (
        "{% if not loop.last %}{{ '<|assistant|>\\n'  + message['content'] + eos_token + '\\n' }}"
        "{% else %}{{ '<|assistant|>\\n'  + message['content'] + eos_token }}{% endif %}",
        "{{ '<|assistant|>\\n' }}{% generation %}{{ message['content'] + eos_token }}"
        "{% endgeneration %}{% if not loop.last %}{{ '\\n' }}{% endif %}",
        1,
    ),
)

# Qwen2.5's added tokens after Qwen2-VL's (ids 151657..151664 there, plain added tokens, not special)
_QWEN2_5_ADDED = tuple(
    "<tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> "
    "<|repo_name|> <|file_sep|>".split()
)


@dataclass(frozen=True)
class Family:
    """One chat format: its released and generation-marked templates and the tokens its tokenizer
    adds to Qwen2-VL's (`special` as special tokens, `plain` as ordinary added tokens, in id order)."""

    name: str
    release: str
    template: str
    generation_template: str
    special: tuple[str, ...] = ()
    plain: tuple[str, ...] = ()
    bos_token: str | None = None
    eos_token: str | None = None

    @property
    def reserved(self) -> tuple[str, ...]:
        """Every added token of this family's tokenizer (Qwen2-VL's included): no drawn text holds one."""
        return QWEN2_VL_SPECIAL_TOKENS + self.special + self.plain


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "qwen2_vl",
            "Qwen/Qwen2-VL-7B-Instruct",
            QWEN2_VL_TEMPLATE,
            QWEN2_VL_GENERATION_TEMPLATE,
        ),
        Family(
            "qwen2_5",
            "Qwen/Qwen2.5-7B-Instruct",
            QWEN2_5_TEMPLATE,
            QWEN2_5_GENERATION_TEMPLATE,
            plain=_QWEN2_5_ADDED,
        ),
        Family(
            "qwen3",
            "Qwen/Qwen3-8B",
            QWEN3_TEMPLATE,
            QWEN3_GENERATION_TEMPLATE,
            plain=(*_QWEN2_5_ADDED, "<tool_response>", "</tool_response>", "<think>", "</think>"),
        ),
        Family(
            "llama3_1",
            "meta-llama/Llama-3.1-8B-Instruct",
            LLAMA3_1_TEMPLATE,
            LLAMA3_1_GENERATION_TEMPLATE,
            special=tuple(
                "<|begin_of_text|> <|end_of_text|> <|start_header_id|> <|end_header_id|> "
                "<|eom_id|> <|eot_id|> <|python_tag|> <|finetune_right_pad_id|>".split()
            ),
            bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>",
        ),
        Family(
            "gemma3",
            "google/gemma-3-4b-it",
            GEMMA3_TEMPLATE,
            GEMMA3_GENERATION_TEMPLATE,
            special=tuple(
                "<pad> <eos> <bos> <unk> <start_of_turn> <end_of_turn> <start_of_image> "
                "<end_of_image> <image_soft_token>".split()
            ),
            bos_token="<bos>",
            eos_token="<eos>",
        ),
        # OLMo 2's bos and eos are both <|endoftext|>, which Qwen2's vocabulary already has; its
        # <|system|>, <|user|> and <|assistant|> headers are plain text there as in OLMo 2
        Family(
            "olmo2",
            "allenai/OLMo-2-1124-7B-Instruct",
            OLMO2_TEMPLATE,
            OLMO2_GENERATION_TEMPLATE,
            bos_token="<|endoftext|>",
            eos_token="<|endoftext|>",
        ),
    )
}


@functools.cache
def family_tokenizer(family: str, generation: bool = False) -> Any:
    """Qwen2's real tokenizer (`qwen2_vl_tokenizer`) with `family`'s released template (or, with
    `generation`, its marked copy), the family's tokens added as single tokens and its bos/eos set.

    Cached per (family, generation): the same object is handed to every caller, so do not change it
    (copy it with `copy.deepcopy` first)."""
    spec = FAMILIES[family]
    tokenizer = qwen2_vl_tokenizer(spec.generation_template if generation else spec.template)
    if spec.plain:
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in spec.plain])
    if spec.special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(spec.special)})
    if spec.bos_token is not None:
        tokenizer.bos_token = spec.bos_token
    if spec.eos_token is not None:
        tokenizer.eos_token = spec.eos_token
    for token in spec.reserved:
        if len(tokenizer.encode(token, add_special_tokens=False)) != 1:
            raise RuntimeError(f"{family}: {token!r} is not a single token")
    return tokenizer
