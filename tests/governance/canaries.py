"""Planted PII and secrets. Each entry: (entity expected, text snippet, raw strings that must never leak)."""

PEM_BODY = [
    "MIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gunVTLw7onLRnrq0",
    "/vGr1l3ZVa3B9f5kZEwzW6ZDTzS3mbT+EaJQEYeOiuBcLTfq6a0zMZ0Zx8HmHvU2xNRuKcVPhR4",
]
PEM = "-----BEGIN RSA PRIVATE KEY-----\n" + "\n".join(PEM_BODY) + "\n-----END RSA PRIVATE KEY-----"

CANARIES = [
    ("PERSON", "My name is Margaret Thompson and I live in Ohio.", ["Margaret Thompson", "Thompson"]),
    ("PERSON", "Please forward this to Robert Kowalski tomorrow.", ["Robert Kowalski", "Kowalski"]),
    ("EMAIL_ADDRESS", "Reach me at margaret.thompson@examplecorp.com anytime.", ["margaret.thompson@examplecorp.com"]),
    ("PHONE_NUMBER", "Call me on (415) 555-0198 after six.", ["555-0198", "(415) 555-0198"]),
    ("PHONE_NUMBER", "My mobile is +44 20 7946 0958.", ["7946 0958"]),
    ("CREDIT_CARD", "Charge card 4111 1111 1111 1111 exp 09/27.", ["4111 1111 1111 1111", "4111111111111111"]),
    ("CREDIT_CARD", "Backup card: 5500-0000-0000-0004.", ["5500-0000-0000-0004", "5500000000000004"]),
    ("US_SSN", "My social security number is 536-22-8914.", ["536-22-8914", "536228914"]),
    ("IBAN_CODE", "Wire it to DE89 3704 0044 0532 0130 00 please.", ["DE89 3704 0044 0532 0130 00",
                                                                    "DE89370400440532013000"]),
    ("IP_ADDRESS", "The server is at 203.0.113.77 on port 22.", ["203.0.113.77"]),
    ("AWS_ACCESS_KEY", "aws_access_key_id = AKIAQ3EGRTYVXZ7LMN4P", ["AKIAQ3EGRTYVXZ7LMN4P"]),
    ("AWS_SECRET_KEY", "aws_secret_access_key = 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",
     ["wJalrXUtnFEMI/K7MDENG/bPxRfiCY8xQz3LpKe2"]),
    ("GITHUB_TOKEN", "export GH_TOKEN=ghp_R8sT2vW9xY4zA1bC6dE3fG7hJ0kL5mN2pQ8r", ["ghp_R8sT2vW9xY4zA1bC6dE3fG7hJ0kL5mN2pQ8r"]),
    ("GITHUB_TOKEN", "token github_pat_11ABCDEFG0aBcDeFgHiJkL_mNoPqRsTuVwXyZ0123456789abcdefghijKLMNOPQRSTU",
     ["github_pat_11ABCDEFG0aBcDeFgHiJkL_mNoPqRsTuVwXyZ0123456789abcdefghijKLMNOPQRSTU"]),
    ("OPENAI_API_KEY", "OPENAI_API_KEY=sk-proj-Xy7Qw2Er5Ty8Ui1Op4As7Df0Gh3Jk6Lz", ["sk-proj-Xy7Qw2Er5Ty8Ui1Op4As7Df0Gh3Jk6Lz",
                                                                              "Xy7Qw2Er5Ty8Ui1Op4As7Df0Gh3Jk6Lz"]),
    ("ANTHROPIC_API_KEY", "key sk-ant-api03-Zx9Cv8Bn7Mm6Aa5Ss4Dd3Ff2Gg1Hh0JjKkLl-QQ",
     ["sk-ant-api03-Zx9Cv8Bn7Mm6Aa5Ss4Dd3Ff2Gg1Hh0JjKkLl-QQ"]),
    ("SLACK_TOKEN", "SLACK_BOT=xoxb-2048204820-4096409640-QwErTyUiOpAsDfGhJkLzXcVb", ["xoxb-2048204820-4096409640"]),
    ("STRIPE_KEY", "stripe.api_key = 'sk_live_51HqLyjWDarjtT1zdp7dcQwErTy'", ["sk_live_51HqLyjWDarjtT1zdp7dcQwErTy"]),
    ("GOOGLE_API_KEY", "maps key AIzaSyD4n7Kq9Xw2Lp5Rt8Yv1Bc3Nm6Hj0Gf4Sd", ["AIzaSyD4n7Kq9Xw2Lp5Rt8Yv1Bc3Nm6Hj0Gf4Sd"]),
    ("JWT", "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJtYXJnYXJldCJ9.Q8zX4kP2mN7vB1cL9sD3fG6hJ0wE5rT",
     ["eyJzdWIiOiJtYXJnYXJldCJ9", "Q8zX4kP2mN7vB1cL9sD3fG6hJ0wE5rT"]),
    ("PRIVATE_KEY", "Here is my key:\n" + PEM + "\nthanks", PEM_BODY),
    ("URL_PASSWORD", "DATABASE_URL=postgres://app:Hunter2Secret!@db.internal:5432/prod", ["Hunter2Secret!"]),
]

ALL_RAW = sorted({raw for _, _, raws in CANARIES for raw in raws})
