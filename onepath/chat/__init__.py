"""Chat: a checkpoint's chat template, tool schemas, tool-call parsing, and conversations as token ids.

Below train/ (the rollout's prompts and tool episodes) and any serving code alike; it imports neither
the engine nor the ops, and never transformers (docs/chat.md).
"""
