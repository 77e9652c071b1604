class InsufficientFunds(Exception):
    pass


class Account:
    def __init__(self, owner: str, balance: float = 0.0) -> None:
        self.owner = owner
        self.balance = balance
        self.history: list[tuple[str, float]] = []

    def deposit(self, amount: float) -> None:
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount
        self.history.append(("deposit", amount))

    def withdraw(self, amount: float) -> None:
        if amount <= 0:
            raise ValueError("withdrawal must be positive")
        if amount > self.balance:
            raise InsufficientFunds(f"{self.owner} has only {self.balance:.2f}")
        self.balance -= amount
        self.history.append(("withdraw", amount))

    def transfer(self, other: "Account", amount: float) -> None:
        self.withdraw(amount)
        other.deposit(amount)

    def statement(self) -> str:
        lines = [f"Statement for {self.owner}"]
        for kind, amount in self.history:
            lines.append(f"  {kind:<10} {amount:>10.2f}")
        lines.append(f"  {'balance':<10} {self.balance:>10.2f}")
        return "\n".join(lines)


if __name__ == "__main__":
    alice = Account("Alice", 100.0)
    bob = Account("Bob")
    alice.transfer(bob, 30.0)
    bob.deposit(12.5)
    print(alice.statement())
    print(bob.statement())
