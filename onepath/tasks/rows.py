"""A dataset row in verl's format, as every task writes it and train/data reads it.

A row: {"data_source": str, "prompt": [{"role", "content"}, ...] or str, "ability": str,
"reward_model": {"style": str, "ground_truth": ...}, "extra_info": dict}.
"""


def prompt_text(row: dict) -> str:
    """The prompt as one string: a chat list's contents concatenated, roles dropped.

    v1 applies no chat template; a model that needs one gets its prompts pre-rendered.
    """
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return prompt
    return "".join(message["content"] for message in prompt)
