"""The one exception type swiftkern raises for input it cannot handle."""


class SwiftkernError(ValueError):
    """Bad input: a shape, dtype, device, layer set, prompt, model or option swiftkern refuses.

    The message always says what was wrong and what to do instead; the CLI prints it as one
    line and exits with status 2.
    """
