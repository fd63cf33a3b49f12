"""A model's config read entry by entry, for the converters: an entry no
family reader read, and that is not known to leave the numbers alone, is an
option the conversion would lose, so it is refused by name."""


class ConfigEntries:
    """`values` (a config dict) read through `[]`/`get`; `check_all_read`
    refuses the entries nobody read beyond `neutral`.

    `entry_point` names the public function in the messages, `family` the
    model family.
    """

    verb = "convert"  # what the entry point does, for the messages

    def __init__(self, values, family, entry_point, neutral=()):
        self.values, self.family, self.entry_point = values, family, entry_point
        self.read = set(neutral)

    def __getitem__(self, key):
        if key not in self.values:
            raise ValueError(
                f"`{self.entry_point}` needs `{key}` in the {self.family} config, "
                "which has none."
            )
        self.read.add(key)
        return self.values[key]

    def get(self, key, default=None):
        """The entry, or `default` where it is absent or None."""
        self.read.add(key)
        value = self.values.get(key)
        return default if value is None else value

    def refuse(self, key, why, value=None):
        value = self.values.get(key) if value is None else value
        raise ValueError(
            f"`{self.entry_point}` cannot {self.verb} {self.family} with "
            f"{key}={value!r}: {why}"
        )

    def check_all_read(self):
        unread = sorted(set(self.values) - self.read)
        if unread:
            raise ValueError(
                f"`{self.entry_point}` does not know the {self.family} config "
                f"entries {unread} (values {[self.values[k] for k in unread]}), so "
                f"it cannot promise the same numbers. Nothing was {self.verb}ed."
            )
