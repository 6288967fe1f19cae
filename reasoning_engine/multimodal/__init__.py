"""Images and video in the prompt: loading media, the vision processors, and the items the engine carries."""
