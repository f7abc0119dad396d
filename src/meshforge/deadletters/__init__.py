"""Dead letters: routing a failed message to ``failed.<subject>``, inspecting and re-driving it."""
