"""The built-in output parsers (`fdplug.plugin_api.parsers`): reasoning (`reasoning`), tool calls
(`tool_calls`), and a chat choice read by both (`chat_output`)."""
