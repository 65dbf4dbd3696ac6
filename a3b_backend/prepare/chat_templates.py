"""Chat templates the project writes itself (for checkpoints that ship none).

QWEN36_CHAT_TEMPLATE renders Qwen3.6's chat format, as vLLM's `qwen3` reasoning
parser and `qwen3_coder` tool parser read it: ChatML turns
(`<|im_start|>role ... <|im_end|>`, contents stripped); with tools, the system
turn lists them as JSON lines inside `<tools>`, then the calling convention
and its reminder, then the caller's own system text; tool calls as
`<tool_call><function=NAME>` with one `<parameter=KEY>` block per argument;
consecutive tool results as `<tool_response>` blocks in one user turn.
Thinking is on by default (the generation prompt opens `<think>`);
`enable_thinking=false` closes an empty think block instead. Assistant turns
after the last real user query keep their reasoning in a think block, earlier
ones only with `preserve_thinking=true` (Qwen3.6's thinking preservation).
"""

QWEN36_CHAT_TEMPLATE = r"""
{%- set enable_thinking = enable_thinking if enable_thinking is defined else true -%}
{%- set preserve_thinking = preserve_thinking if preserve_thinking is defined else false -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools %}
{{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n'
    '<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n'
    '<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n'
    '</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n'
    '- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested '
    'within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n'
    '- You may provide optional reasoning for your function call in natural language BEFORE the function call, '
    'but NOT after\n- If there is no function call available, answer the question like normal with your current '
    'knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
{%- if has_system and messages[0].content.strip() %}{{- '\n\n' + messages[0].content.strip() }}{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif has_system %}
{{- '<|im_start|>system\n' + messages[0].content.strip() + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
{%- set text = (message.content or '').strip() %}
{%- if message.role == 'user' and not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) %}
{%- set ns.last_query = loop.index0 %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = (message.content or '').strip() %}
{%- if message.role == 'user' %}
{{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = (message.reasoning_content or '').strip() %}
{%- if not reasoning and '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() %}
{%- set content = content.split('</think>')[-1].strip() %}
{%- endif %}
{{- '<|im_start|>assistant\n' }}
{%- if preserve_thinking or loop.index0 > ns.last_query %}{{- '<think>\n' + reasoning + '\n</think>\n\n' }}{%- endif %}
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
{%- elif message.role == 'system' %}
{%- if not loop.first %}{{- raise_exception('a system message must be the first message') }}{%- endif %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}
{{- raise_exception('unknown message role ' + message.role + ': system, user, assistant or tool') }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt and (not messages or messages[-1].role != 'assistant') %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking %}{{- '<think>\n' }}{%- else %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
""".strip()
