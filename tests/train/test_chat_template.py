"""onepath.chat.template renders a checkpoint's chat template as transformers' apply_chat_template does:
the text, and the token ids, equal on the Qwen3, Llama-3 / 3.1 / 3.2 and DeepSeek-V3 / R1 templates
(tests/data/chat_templates) over system prompts, multi-turn chats, tool definitions (functions and JSON
schemas), tool calls and results, reasoning, generation prompts and extra variables. Where the template
comes from follows transformers too; what it cannot render fails in a line."""
import json

import pytest

from onepath.chat.template import ChatTemplate, ChatTemplateError, special_tokens
from tests.chat_families import hf_tokenizer, template_text, tokenizer, tokenizer_config

NAMES = ["qwen3", "llama3", "llama3.1", "llama3.2", "deepseek_v3", "deepseek_r1"]


def get_weather(city: str, unit: str = "celsius") -> str:
    """Get the current weather in a city.

    Args:
        city: The city, e.g. "Paris".
        unit: The temperature unit (choices: ["celsius", "fahrenheit"])

    Returns:
        The weather, in words.
    """
    return f"sunny in {city}"


SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the web.",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string", "description": "What to look for"}},
                                               "required": ["query"]}}}


def calls(family, *names):
    """Assistant tool calls; DeepSeek's templates join the arguments into text, the others print a dict."""
    args = {"city": "Paris", "unit": "celsius"}
    return [{"id": f"call_{i}", "type": "function",
             "function": {"name": n, "arguments": json.dumps(args) if family.startswith("deepseek") else args}}
            for i, n in enumerate(names)]


def conversations(family):
    one_call = 1 if family.startswith("llama3.") else 2   # Llama 3.1 / 3.2 take one call per turn
    return [
        [{"role": "user", "content": "Hi there"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "  Be kind.  "}, {"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}, {"role": "user", "content": "And 3+3?"},
         {"role": "assistant", "content": "6", "reasoning_content": "add again"}, {"role": "user", "content": "ok"}],
        [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": calls(family, *["get_weather", "search"][:one_call])},
         {"role": "tool", "name": "get_weather", "tool_call_id": "call_0", "content": "sunny, 21C"},
         *([{"role": "tool", "name": "search", "tool_call_id": "call_1", "content": "no results"}] if one_call == 2
           else []),
         {"role": "assistant", "content": "It is sunny.", "thinking": "the tool said so"},
         {"role": "user", "content": "Thanks"}],
    ]


def ours(family):
    config = tokenizer_config(family)
    return ChatTemplate({"default": config["chat_template"]}, family, special_tokens(config))


CASES = [(name, i, agp, tools) for name in NAMES for i in range(4) for agp in (False, True)
         for tools in (None, "function", "both") if not (name == "llama3" and tools)]


@pytest.mark.parametrize("family, case, agp, tools", CASES)
def test_render_equals_transformers(family, case, agp, tools):
    messages = conversations(family)[case]
    tool_list = {None: None, "function": [get_weather], "both": [get_weather, SEARCH]}[tools]
    hf = hf_tokenizer(family)
    want = hf.apply_chat_template(messages, tools=tool_list, add_generation_prompt=agp, tokenize=False)
    assert ours(family).render(messages, tools=tool_list, add_generation_prompt=agp) == want
    ids = hf.apply_chat_template(messages, tools=tool_list, add_generation_prompt=agp, tokenize=True, return_dict=False)
    text = ours(family).render(messages, tools=tool_list, add_generation_prompt=agp)
    assert tokenizer(family).encode(text, add_special_tokens=False).ids == ids


@pytest.mark.parametrize("family, kwargs", [
    ("qwen3", {"enable_thinking": False}), ("qwen3", {"enable_thinking": True}),
    ("llama3.1", {"date_string": "01 Jan 2025", "tools_in_user_message": False}),
    ("llama3.1", {"builtin_tools": ["brave_search", "wolfram_alpha"]}),
    ("llama3.2", {}),                                # strftime_now("%d %b %Y") for today's date
    ("llama3.2", {"custom_tools": [SEARCH], "tools_in_user_message": False}),
    ("deepseek_v3", {"bos_token": "<BOS>"}),          # a keyword wins over the special token of its name
])
def test_extra_variables_equal_transformers(family, kwargs):
    messages = conversations(family)[1]
    tools = [get_weather] if family.startswith("llama3.1") else None
    want = hf_tokenizer(family).apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                                    **kwargs)
    assert ours(family).render(messages, tools=tools, add_generation_prompt=True, **kwargs) == want


def test_builtin_tool_call_renders_the_python_tag_form():
    messages = [{"role": "user", "content": "Search for cats"},
                {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                    "name": "brave_search", "arguments": {"query": "cats"}}}]},
                {"role": "ipython", "content": "cats are mammals"}]
    kwargs = {"builtin_tools": ["brave_search"]}
    want = hf_tokenizer("llama3.1").apply_chat_template(messages, tokenize=False, **kwargs)
    got = ours("llama3.1").render(messages, **kwargs)
    assert got == want and '<|python_tag|>brave_search.call(query="cats")<|eom_id|>' in got


def test_none_valued_keys_are_dropped_as_transformers_does():
    messages = [{"role": "user", "content": "Hi", "name": None},
                {"role": "assistant", "content": "Hello", "tool_calls": None, "reasoning_content": None}]
    want = hf_tokenizer("qwen3").apply_chat_template(messages, tokenize=False)
    assert ours("qwen3").render(messages) == want


def test_raise_exception_is_a_clear_error_and_transformers_refuses_too():
    from jinja2.exceptions import TemplateError
    messages = [{"role": "system", "content": "tools but no user"}]
    with pytest.raises(TemplateError, match="no first user message"):
        hf_tokenizer("llama3.1").apply_chat_template(messages, tools=[get_weather], tokenize=False)
    with pytest.raises(ChatTemplateError, match=r"chat template llama3.1 refused the conversation: Cannot put tools "
                                                r"in the first user message when there's no first user message"):
        ours("llama3.1").render(messages, tools=[get_weather])


def test_tojson_arguments_and_loop_controls():
    source = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m | tojson(indent=2, "
              "sort_keys=true) }}{% generation %}<{{ m.role }}>{% endgeneration %}{% endfor %}"
              "{{ {'é': 1} | tojson }}{{ {'a': 1, 'b': [2]} | tojson(separators=(',', ':')) }}")
    messages = [{"role": "user", "content": "é <b>"}, {"role": "assistant", "content": "x"}, {"role": "user",
                                                                                          "content": "y"}]
    hf = hf_tokenizer("qwen3")
    want = hf.apply_chat_template(messages, chat_template=source, tokenize=False)
    assert ChatTemplate({"default": source}, "inline").render(messages) == want
    assert '"é <b>"' in want and '{"a":1,"b":[2]}' in want   # no HTML escaping, ensure_ascii off


def test_named_templates_pick_tool_use_with_tools_and_default_without(tmp_path):
    default, tool_use = "DEFAULT{{ messages[0].content }}", "TOOLS{{ tools | length }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "<|im_end|>", "special": True, "__type": "AddedToken"},
        "chat_template": [{"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}]}))
    t = ChatTemplate.from_checkpoint(tmp_path)
    messages = [{"role": "user", "content": "x"}]
    assert t.render(messages) == "DEFAULTx" and t.render(messages, tools=[SEARCH]) == "TOOLS1"
    assert t.render(messages, tools=[SEARCH, SEARCH], name="tool_use") == "TOOLS2"
    assert t.render(messages, tools=[SEARCH], name="default") == "DEFAULTx"
    assert t.special_tokens == {"eos_token": "<|im_end|>"}
    hf = hf_tokenizer("qwen3")
    hf.chat_template = {"default": default, "tool_use": tool_use}
    assert hf.apply_chat_template(messages, tools=[SEARCH], tokenize=False) == "TOOLS1"
    with pytest.raises(ChatTemplateError, match=r"'rag' is not in .*: it has default, tool_use"):
        t.render(messages, name="rag")


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "CONFIG", "bos_token": "<s>"}))
    assert ChatTemplate.from_checkpoint(tmp_path).render([{"role": "user", "content": "x"}]) == "CONFIG"
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}FILE")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("EXTRA")
    t = ChatTemplate.from_checkpoint(tmp_path)
    assert t.render([{"role": "user", "content": "x"}]) == "<s>FILE" and set(t.templates) == {"default", "tool_use"}
    from transformers import AutoTokenizer
    from tests.chat_families import tokenizer as family_tokenizer
    family_tokenizer("qwen3").save(str(tmp_path / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "<s>FILE"


def test_template_files_and_a_checkpoint_without_one(tmp_path):
    assert ChatTemplate.from_checkpoint(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert ChatTemplate.from_checkpoint(tmp_path) is None
    (tmp_path / "t.jinja").write_text("{{ eos_token }}{{ messages[0].content }}")
    assert ChatTemplate.from_file(tmp_path / "t.jinja", {"eos_token": "</s>"}).render([{"role": "user",
                                                                                         "content": "x"}]) == "</s>x"
    (tmp_path / "c.json").write_text(json.dumps({"chat_template": "J", "bos_token": "<s>"}))
    assert ChatTemplate.from_file(tmp_path / "c.json").render([{"role": "user", "content": "x"}]) == "J"
    with pytest.raises(ChatTemplateError, match="has no chat_template"):
        ChatTemplate.from_file(tmp_path / "tokenizer_config.json")
    with pytest.raises(FileNotFoundError, match="nowhere.jinja does not exist"):
        ChatTemplate.from_file(tmp_path / "nowhere.jinja")
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        ChatTemplate.from_file(tmp_path / "t.jinja").render([])


@pytest.mark.parametrize("source, match", [
    ("{{ messages | no_such_filter }}", r"does not compile \(line 1: No filter named 'no_such_filter'"),
    ("{% for m in messages %}{{ m.content }}", r"does not compile \(line 1: Unexpected end of template"),
    ("{% do messages.append(1) %}", r"does not compile"),   # the do statement is not enabled, as in transformers
    ("{{ messages.append({'role': 'x'}) }}", r"does what the sandbox forbids"),
    ("{% set ns = namespace(_private=1) %}", r"does what the sandbox forbids.*may not start with '_'"),
    ("{{ messages[5].content + 'x' }}", r"refused the conversation"),
    ("{{ 1 + messages }}", r"failed on the conversation \(TypeError"),
])
def test_templates_needing_what_the_renderer_lacks_fail_in_a_line(source, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate({"default": source}, "inline").check().render([{"role": "user", "content": "x"}])


def test_the_published_texts_are_whole_templates():
    for name in NAMES:
        text = template_text(name)
        assert "add_generation_prompt" in text and len(text) > 300, name
    assert all(key in template_text("qwen3") for key in ("<tool_call>", "<tool_response>", "reasoning_content"))
    assert all(key in template_text("llama3.1") for key in ("ipython", "<|python_tag|>", "builtin_tools"))
    assert all(key in template_text("deepseek_v3") for key in ("tool▁calls▁begin", "tool▁outputs▁end"))
