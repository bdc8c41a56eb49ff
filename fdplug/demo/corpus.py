"""The text the random models' 512-token BPE is learned from: small, fixed, mixed (prose, code,
numbers, CJK). The golden fixtures' token ids depend on it: change it and regenerate them."""

BPE_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox runs into the forest.
A language model reads a sequence of tokens and predicts the next token. The model is a stack of
transformer layers: each layer has an attention block and a feed forward block, and each block is
wrapped in a residual connection with a normalization before it. The attention block lets every token
look at the tokens before it; the feed forward block transforms each token on its own.
An inference server receives requests from many users at the same time. The scheduler decides which
requests run in each step, how many tokens each one may process, and when a request must wait because
the cache is full. The cache stores the keys and the values of the attention layers in blocks, so that
the server does not compute them again for the tokens it has already seen.
Hello, world! How are you today? I am fine, thank you. What is the weather like where you are?
It is sunny and warm here, but the weather report says that it will rain in the evening.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

class Request:
    def __init__(self, prompt, max_tokens=16):
        self.prompt = prompt
        self.max_tokens = max_tokens
{"role": "user", "content": "Write a short poem about the sea."}
{"role": "assistant", "content": "The sea is wide, the sea is deep, the sea is where the sailors sleep."}
The numbers one, two, three, four, five, six, seven, eight, nine and ten; 1, 2, 3, 4, 5, 6, 7, 8, 9, 10.
In the beginning there was the word, and the word was written in the book, and the book was read by
the people of the town. They read the book in the morning and in the evening, and they talked about
the story with their friends and with their families.
你好，世界！今天天气很好。我们一起去公园散步吧。语言模型是一个很有用的工具。
"""
