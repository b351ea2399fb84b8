"""A dataset row in verl's format, as every task writes it and train/data reads it.

A row: {"data_source": str, "prompt": [{"role", "content"}, ...] or str, "ability": str,
"reward_model": {"style": str, "ground_truth": ...}, "extra_info": dict}.
"""


def prompt_text(row: dict) -> str:
    """The prompt as one string: a chat list's contents concatenated, roles dropped. What the model reads
    when no chat template is in use (data.chat_template, train/data.Prompts), and the reward's prompt."""
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return prompt
    return "".join(message["content"] for message in prompt)
