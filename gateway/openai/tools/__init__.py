"""Tool calling in the OpenAI API: the request's tools and tool_choice (plan.py), the conversation as
the chat template reads it (messages.py), and the model's text read back into `tool_calls` (reader.py).

The call format of the served model (tokenization/tool_formats.py) decides how calls look in the text;
the worker constrains them with a grammar built from the same format (grammar/tool_calls.py).
"""
