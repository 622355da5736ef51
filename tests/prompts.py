"""Prompts of mixed lengths for parity tests; half share a long prefix."""
from __future__ import annotations

SHARED_PREFIX = (
    "You are a careful assistant who answers questions about geography, history and science. "
    "Always answer in one short sentence, and never make up facts you do not know. "
    "When a question is ambiguous, pick the most common reading and answer that. "
    "Here is the question you need to answer now: "
)

QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "Who wrote Hamlet?",
    "How many legs does a spider have?", "What is the boiling point of water?",
    "Which planet is the largest?", "What language is spoken in Brazil?",
    "Who painted the Mona Lisa?", "What is photosynthesis?", "How far is the Moon?",
    "What is the tallest mountain?", "When did World War II end?",
    "What is the chemical symbol for gold?", "Which ocean is the biggest?",
    "What is the speed of light?", "Who discovered penicillin?",
]

OPENINGS = [
    "Hello", "The quick brown fox", "Once upon a time, in a land far away,",
    "def fibonacci(n):", "List three fruits:", "Translate to French: good morning",
    "The history of the Roman Empire began when",
    "In 1969, astronauts landed on the Moon. The mission was called",
    "Write a haiku about the sea.", "Explain gravity to a child in two sentences.",
    "A recipe for pancakes needs flour, eggs, milk and",
    "The three primary colors are",
    "Here is a long story about a dragon who lived in a cave near a village. Every morning "
    "the dragon woke up, stretched its wings, and looked out over the valley below. The "
    "villagers were afraid of it at first, but over the years they learned that the dragon "
    "only wanted company. One day a small girl climbed the hill with a basket of bread and",
    "Q: What is 2 + 2?\nA:", "Shopping list:\n1.", "Dear Sir or Madam, I am writing to",
]


def mixed_prompts() -> list[str]:
    """32 prompts: 16 plain openings of varied length, 16 sharing a ~60-token prefix."""
    return OPENINGS + [SHARED_PREFIX + q for q in QUESTIONS]
