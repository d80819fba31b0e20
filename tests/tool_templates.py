"""Small chat templates that render tools, in the styles of the models trained for them (after the
templates vLLM ships in examples/): the tools as JSON in the prompt, an assistant's `tool_calls` written as
the model writes calls, tool results in their own turn. transformers renders templates with trim_blocks,
so a newline that follows a block tag is written `{{ "\\n" }}`."""

NL = '{{ "\\n" }}'

# Llama 3.1 (vLLM's tool_chat_template_llama3.1_json.jinja): JSON calls with "parameters", results as ipython
LLAMA_TEMPLATE = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "Given the following functions, please respond with a JSON for a function call with its proper arguments that "
    "best answers the given prompt.\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\n'
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for c in m.tool_calls %}{% if not loop.first %}; {% endif %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}<|eot_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    '{{ {"output": m.content, "name": m.name, "id": m.tool_call_id} | tojson }}<|eot_id|>'
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Llama 3.2 pythonic (vLLM's tool_chat_template_llama3.2_pythonic.jinja): calls as a Python list
PYTHONIC_TEMPLATE = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "You have access to the following functions. To call functions, please respond with a python list of the calls. "
    "Respond in the format [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n["
    "{% for c in m.tool_calls %}{% if not loop.first %}, {% endif %}{{ c.function.name }}("
    "{% for k, v in c.function.arguments.items() %}{% if not loop.first %}, {% endif %}{{ k }}={{ v | tojson }}"
    "{% endfor %}){% endfor %}]<|eot_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    '{{ {"output": m.content, "name": m.name} | tojson }}<|eot_id|>'
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Qwen2.5 / Hermes: <tools> in the system message, <tool_call> blocks, results in one user turn
QWEN_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\n<tools>{% for t in tools %}" + NL + "{{ t | tojson }}{% endfor %}" + NL + "</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}"
    + NL + "<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{% if not loop.first or m.content %}" + NL + "{% endif %}"
    '<tool_call>\n{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
