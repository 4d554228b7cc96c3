"""Special tokens of the built-in tokenizer and their fixed ids (pure Python, no imports),
shared by the tokenizer files and config.json / generation_config.json."""

EOS_TOKEN, BOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|bos|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, BOS_TOKEN, PAD_TOKEN, IM_START, IM_END)
EOS_ID, BOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

# ChatML; generation stops on eos, so an engine that wants chat turns to end should also
# stop on IM_END_ID.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
