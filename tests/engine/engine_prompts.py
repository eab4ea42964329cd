"""Varied prompts for equivalence tests: short, long (> 512 tokens), several languages, code."""

from __future__ import annotations

_LONG_STORY = " ".join(
    f"Chapter {i}: the river town of Elmsworth woke slowly; the baker counted {i * 7} loaves, "
    f"the ferryman crossed {i + 2} times, and the clock in the square struck {i % 12 + 1}."
    for i in range(1, 30)
)

PROMPTS: list[str] = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "La tour Eiffel est située à",
    "Die Hauptstadt von Deutschland ist",
    "東京は日本の",
    "人工智能的未来是",
    "Столица России —",
    "#include <stdio.h>\nint main(void) {\n    printf(",
    "Q: What is 17 * 23?\nA:",
    "Once upon a time, in a land far away, there lived a dragon who",
    "SELECT name, COUNT(*) FROM orders GROUP BY",
    "I love pizza 🍕 and sushi 🍣 because",
    "Summarize the following story in one sentence.\n" + _LONG_STORY + "\nSummary:",
    "List three primary colors:\n1.",
    "El aprendizaje automático es",
]
