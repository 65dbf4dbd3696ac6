"""Chat templates the project writes itself (for checkpoints that ship none).

QWEN36_CHAT_TEMPLATE renders Qwen3.6's chat format, as vLLM's `qwen3` reasoning
parser and `qwen3_coder` tool parser read it: ChatML turns
(`<|im_start|>role ... <|im_end|>`); tool definitions as JSON lines inside
`<tools>` in the system turn, tool calls as `<tool_call><function=NAME>` with
one `<parameter=KEY>` block per argument, tool results as `<tool_response>` in
a user turn; thinking on by default (the generation prompt opens `<think>`),
`enable_thinking=false` closes an empty think block instead; earlier
assistant turns keep their reasoning only after the last user query.
"""

QWEN36_CHAT_TEMPLATE = r"""
{%- set enable_thinking = enable_thinking if enable_thinking is defined else true -%}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content or '' %}
{%- set reasoning = message.reasoning_content or '' %}
{%- if not reasoning and '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{{- '<|im_start|>assistant\n' }}
{%- if loop.index0 > ns.last_query %}{{- '<think>\n' + reasoning + '\n</think>\n\n' }}{%- endif %}
{{- content }}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function if call.function is defined else call %}
{%- if loop.first and content %}{{- '\n\n' }}{%- elif not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n<function=' + call.name + '>\n' }}
{%- set arguments = call.arguments if call.arguments is mapping else {} %}
{%- for key, value in arguments.items() %}
{{- '<parameter=' + key + '>\n' + (value if value is string else (value | tojson)) + '\n</parameter>\n' }}
{%- endfor %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking %}{{- '<think>\n' }}{%- else %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
""".strip()
