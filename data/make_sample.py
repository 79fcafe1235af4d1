"""Generate lowtide's sample data: support messages, their hidden labels, a gold eval set, the
output schema, a dated price table and the example job file.

Everything is synthetic, built from phrase banks with one fixed seed, so a rerun writes
byte-identical files. The data is shaped around the emulator's deterministic "model" (see
`rule_pick`): most messages carry a cue word of their true intent and some carry cue words of
other labels, so the emulator's accuracy lands between useless and perfect, and a change in a
prompt, a chunker or a parser shows up as a change in the eval score.

    .venv/bin/python data/make_sample.py              # rewrite the files under data/
    .venv/bin/python data/make_sample.py --out DIR    # write the same files under DIR instead
    .venv/bin/python data/make_sample.py --check      # cue-rule accuracy, lengths, duplicates

Only the standard library is needed to generate; `--check` also uses polars and lowtide.tokens.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import random
import re
import sys
import unicodedata
from collections.abc import Callable, Sequence
from datetime import date, timedelta
from pathlib import Path

SEED = 20261129
DATA_DIR = Path(__file__).resolve().parent

N_MESSAGES = 3000
N_EXACT_DUPLICATES = 150  # 5 %: the same body again under a new message_id
N_NEAR_DUPLICATES = 60  # 2 %: the same body up to whitespace and letter case
N_HUGE = 30  # 1 %: a pasted log, table or chat transcript of 3,000-6,000 tokens
N_LONG = 232  # with the long ones that get duplicated, about 8 % run to 300-1,000 words
N_EVAL_PER_INTENT = 20

STORE = "Brightbasket"

INTENTS = (
    "order_status",
    "refund_request",
    "billing_issue",
    "shipping_delay",
    "damaged_item",
    "account_access",
    "cancel_subscription",
    "product_question",
    "change_address",
    "complaint",
)
URGENCIES = ("low", "normal", "urgent")

INTENT_WEIGHTS = {
    "order_status": 14,
    "refund_request": 13,
    "billing_issue": 10,
    "shipping_delay": 12,
    "damaged_item": 9,
    "account_access": 9,
    "cancel_subscription": 9,
    "product_question": 10,
    "change_address": 6,
    "complaint": 8,
}
# (low, normal, urgent) per intent: a locked account is urgent more often than a size question.
URGENCY_PRIORS = {
    "order_status": (30, 55, 15),
    "refund_request": (20, 60, 20),
    "billing_issue": (15, 55, 30),
    "shipping_delay": (20, 55, 25),
    "damaged_item": (20, 55, 25),
    "account_access": (15, 50, 35),
    "cancel_subscription": (30, 55, 15),
    "product_question": (55, 40, 5),
    "change_address": (20, 50, 30),
    "complaint": (20, 60, 20),
}
CHANNELS = {"email": 40, "chat": 25, "web_form": 25, "app_review": 10}
TIERS = {"free": 55, "plus": 33, "business": 12}

CUE_RATE = 0.86  # the opening sentence names the intent's own cue word
SECOND_CUE_RATE = 0.2  # ... and a later sentence names it again
DISTRACTOR_RATE = 0.3  # a sentence mentions another label's cue word in passing
URGENT_CUE_RATE = 0.85  # an urgent message says "urgent"; other messages never do
LOW_PHRASE_RATE = 0.55  # a low-urgency message says there is no hurry (some say "low priority")
TYPO_RATE = 0.05

# --------------------------------------------------------------------------------------------
# Phrase banks. {slot} names are filled per message by `Slots`; a slot used twice in one message
# gets the same value, `product2`/`amount2`/`street2` are distinct second values.
#
# CUE sentences contain a cue word of their intent; PLAIN and DETAIL sentences (and every bank
# below them marked neutral) must contain no label keyword at all, which a test checks.
# DISTRACT sentences belong to their intent but mention another label's cue word.
# --------------------------------------------------------------------------------------------

CUE = {
    "order_status": [
        "Can you tell me the status of order {order}?",
        "What's the status of my order? It's {order}.",
        "I placed an order on {date} and it still says 'processing'.",
        "Where is my order {order}?",
        "Any news on order {order}? I ordered the {product} on {date}.",
        "Has order {order} been sent out yet?",
        "Could you check on order {order} for me? I can't tell if it went out.",
        "I ordered a {product} {days} days ago and haven't had a single update.",
        "The order page hasn't moved since {date}.",
        "Just wondering what's happening with my order for the {product}.",
        "Is there any way to see where my order is? The confirmation email had no link.",
        "My order {order} says 'preparing' and has done for a week.",
    ],
    "refund_request": [
        "I'd like a refund for the {product}, please.",
        "Please refund {amount} to my {card}.",
        "I sent the {product} back on {date}; when will I see the refund?",
        "I'm requesting a full refund because the {product} doesn't work as described.",
        "Can I get a refund instead of store credit?",
        "Your warehouse got my return {days} days ago and there's still no refund.",
        "I returned the {product} and would like the {amount} refunded.",
        "I was promised a refund on {date} and nothing has come through.",
        "How long do refunds usually take to show up on a card?",
        "Refund please for the {product}, which I sent back unopened.",
        "I've requested my money back twice now for the {product}.",
    ],
    "billing_issue": [
        "There's a billing problem on my {plan}: I was charged {amount} twice.",
        "I think there's an issue with my latest invoice, it's {amount} more than usual.",
        "Your billing system charged my {card} after I'd already paid with PayPal.",
        "The billing page shows a charge on {date} that I don't recognise.",
        "Can someone in billing explain the {amount} fee on my invoice?",
        "There's an issue with the VAT on our invoice; we're a registered business in {country}.",
        "The billing date moved from the 1st to the 15th without any warning.",
        "I keep getting billing emails saying my payment failed, but my bank shows it went through.",
        "Billing took {amount} instead of the {amount2} shown at checkout.",
        "Same issue as last month: two payments of {amount} on the same day.",
    ],
    "shipping_delay": [
        "My parcel is delayed again and the {carrier} site just says 'exception'.",
        "Shipping was supposed to take 3-5 days and it's now been {days}.",
        "Why is shipping taking so long? I paid for express.",
        "The delivery has been delayed three times now.",
        "It shipped on {date} and the tracking hasn't moved since.",
        "Your email said it shipped on {date} but {carrier} has no record of it.",
        "What's causing the delay? It was due on {date}.",
        "I paid {amount} for next-day shipping and it's been a week.",
        "{carrier} keeps saying there's a delay at the depot in {city}.",
        "Still waiting on the {product}, it's delayed by {days} days now.",
    ],
    "damaged_item": [
        "The {product} arrived damaged; the box was crushed flat.",
        "One item in the parcel was broken when I opened it.",
        "The {breakable} came with a cracked base and the item is unusable.",
        "The parcel was damaged in transit and the {product} inside is dented.",
        "Two items were smashed, the rest looked fine.",
        "The {furniture} is damaged: there's a long scratch across the top.",
        "I received a damaged {product}. Can you send a replacement?",
        "Every item in the box was wet and the cardboard was falling apart.",
        "The {product} looks like it was damaged before it was even packed.",
    ],
    "account_access": [
        "I can't log into my account; the reset link never arrives.",
        "My account is locked after too many attempts.",
        "I've lost access to the email on my account. How do I get back in?",
        "Two-factor codes aren't coming through, so I'm locked out of my account.",
        "Someone may have accessed my account, I got a sign-in alert from {city}.",
        "The app says my account doesn't exist, but I've used it for years.",
        "I need access to my account to download invoices and it won't let me in.",
        "Please unlock my account, I'm the owner and can prove who I am.",
        "Our team lost access to the business account when our admin left.",
        "Every time I try to access my account I get sent back to the home page.",
    ],
    "cancel_subscription": [
        "Please cancel my {plan} subscription.",
        "How do I cancel? I can't find the option anywhere.",
        "I want to cancel before the next renewal on {date}.",
        "Cancel my subscription effective immediately and confirm by email, please.",
        "I'd like to end my subscription; it's too expensive for me now.",
        "I tried to cancel in the app but it just shows an error.",
        "I cancelled on {date} but I was charged again.",
        "We're moving to another supplier, so please cancel the {plan}.",
        "Could you cancel the {plan}? We have far too much at home.",
        "Please don't renew my subscription this year.",
    ],
    "product_question": [
        "Quick question about the {kitchen}: is it dishwasher safe?",
        "Is this product compatible with {device}?",
        "I have a question about sizing for the {clothing}.",
        "Does the {product} come with a warranty? The product page doesn't say.",
        "Question before I buy: what's the {product} made of?",
        "Are your products tested on animals?",
        "One question about the {gadget}: how long does the battery last?",
        "The product description mentions two colours but I can only pick one.",
        "Is the {product} the same product as the one in your catalogue from last year?",
    ],
    "change_address": [
        "I need to change the delivery address on order {order}.",
        "I've moved, please update my address to {street}, {postcode} {city}.",
        "Can I change where the parcel goes? I won't be home that week.",
        "Wrong address on my last purchase: the street should be {street}.",
        "Is it too late to change the address for the {product}?",
        "My address is missing the flat number, it should be Flat {n}, {street}.",
        "We've changed office, new address: {street}, {city}.",
        "Please use my new address from now on: {street}, {postcode} {city}.",
        "The address on file is my old one, can you change it to {street}?",
    ],
    "complaint": [
        "I want to make a formal complaint about how I've been treated.",
        "This is a complaint about your customer service team.",
        "I'm complaining because nobody has answered my last three emails.",
        "I have no complaints about the {product} itself, but your service has been awful.",
        "Please consider this an official complaint.",
        "I complained on {date} and was told someone would call me. Nobody did.",
        "How do I escalate a complaint to a manager?",
        "I'm not one to complain, but this has been the worst shopping experience I've had.",
        "I'd like my complaint passed to someone senior.",
    ],
}

PLAIN = {
    "order_status": [
        "I bought a {product} on {date} and haven't heard anything since. Has it gone out?",
        "The tracking link for {order} just says 'label created'. Is it on its way?",
        "When will the {product} I paid for on {date} actually be sent?",
        "Just checking whether purchase {order} has been packed yet.",
        "It's been {days} days since I paid and the website still shows nothing. What's going on?",
        "Has the {product} left your warehouse yet?",
        "I never got a confirmation email for the {product}. Did it go through?",
        "Can you let me know when the {product} will be dispatched?",
        "Did my purchase on {date} actually go through? I can't see it anywhere.",
    ],
    "refund_request": [
        "I'd like my money back for the {product}, it isn't what I expected.",
        "Could you reverse the {amount} payment? I sent the parcel back last week.",
        "I sent it back, so please put the money back on my {card}.",
        "The {product} went back to you on {date}. Where is my money?",
        "I don't want a replacement, I just want my {amount} back.",
        "Please pay back the {amount} for the {product} to my {card}.",
        "The money for the {product} still hasn't come back to my card.",
    ],
    "billing_issue": [
        "I was charged {amount} twice on {date}. Please fix it.",
        "My {card} was debited {amount} but the invoice says {amount2}.",
        "Why was I charged {amount} when the price on the site was {amount2}?",
        "The promo code was accepted but I still paid full price.",
        "There's a charge of {amount} on my statement that I didn't make.",
        "I paid by bank transfer but the invoice still shows as unpaid.",
        "You took {amount} from my card on {date} and I have no idea what for.",
    ],
    "shipping_delay": [
        "The parcel has been stuck in {city} for {days} days.",
        "Tracking has said 'in transit' for over a week.",
        "The courier keeps pushing the delivery date back.",
        "It was meant to arrive by {date} and there's still nothing.",
        "{carrier} says it's 'awaiting collection' but nobody ever came.",
        "The estimated arrival went from Tuesday to 'unknown'.",
        "My parcel seems to be going round in circles between two depots.",
    ],
    "damaged_item": [
        "The {breakable} arrived with a big crack down the side.",
        "I opened the box and the glass was in pieces.",
        "The {gadget} won't turn on and there's a dent in the casing.",
        "Two of the plates came chipped.",
        "The seal on the {food} was broken and half the contents had spilled.",
        "The {textile} has a tear in the fabric straight out of the box.",
        "The {furniture} is scratched all over and one leg is bent.",
    ],
    "account_access": [
        "I can't sign in. The password reset email never shows up.",
        "The app keeps logging me out and won't let me back in.",
        "Login says 'invalid credentials' but I know the password is right.",
        "I'm stuck in a loop: reset password, sign in, reset password again.",
        "The sign-in code goes to a phone number I no longer have.",
        "I get a blank screen after entering my password.",
        "My login stopped working after I updated the app.",
    ],
    "cancel_subscription": [
        "Please stop the {plan}, I don't want it to renew.",
        "I want to end my membership; don't charge me again.",
        "Turn off auto-renew on my {plan}, please.",
        "I'm moving abroad and won't need the deliveries any more.",
        "How do I stop the recurring payments for the {plan}?",
        "I'd like to stop the {plan} at the end of this month.",
    ],
    "product_question": [
        "Is the {kitchen} dishwasher safe?",
        "What are the dimensions of the {product}?",
        "Does the {gadget} work with a 110V outlet?",
        "Will the {product} be back in stock soon?",
        "Can the {product} be used outdoors?",
        "Is there a bigger size of the {clothing}?",
        "What's the difference between the {product} and the newer model?",
        "Does the {gadget} work with {device}?",
    ],
    "change_address": [
        "Please send it to {street}, {city} instead, I've moved.",
        "Can you redirect the parcel to my work at {street}?",
        "I typed the postcode wrong, it should be {postcode}.",
        "Could the courier leave it with my neighbour at number {n} instead?",
        "I'm moving on {date}; please send future boxes to {street}, {city}.",
        "The house number is wrong on the label, it's {n} not {n2}.",
    ],
    "complaint": [
        "Your customer service has been absolutely useless.",
        "Three weeks and four emails later, still nobody has helped me.",
        "The driver was rude and threw the parcel over the fence.",
        "I'm very disappointed with how this was handled.",
        "The agent on chat closed the conversation while I was still typing.",
        "I was put on hold for 50 minutes and then cut off.",
        "Frankly, the way your staff spoke to me was unacceptable.",
    ],
}

DETAIL = {
    "order_status": [
        "I paid with my {card}.",
        "The confirmation number is {order}.",
        "I chose standard delivery at checkout.",
        "It's a birthday present so I'd like to know roughly when to expect it.",
        "The tracking page just shows a spinning wheel.",
        "I checked the website twice today.",
        "A rough date would be enough.",
    ],
    "refund_request": [
        "The tracking for the return says it reached your warehouse on {date}.",
        "I still have the drop-off receipt from the post office.",
        "It was unopened and still in the original packaging.",
        "The {product} was {amount}.",
        "I used the prepaid return label you emailed me.",
    ],
    "billing_issue": [
        "I can send a screenshot of my bank statement.",
        "The invoice number is INV-{num}.",
        "My {card} is the only card on file.",
        "It's not a huge sum but it adds up.",
        "Our finance team needs a corrected invoice for our records.",
    ],
    "shipping_delay": [
        "The tracking number is {tracking}.",
        "I've been home every day waiting for it.",
        "Other parcels from {carrier} have come fine this week.",
        "I need the {product} for a trip on {date}.",
    ],
    "damaged_item": [
        "I've got photos of the box and the contents.",
        "The outer box looked fine, so it must have happened before it was packed.",
        "I'd prefer a replacement if you have one in stock.",
        "I kept all the packaging in case you need it back.",
    ],
    "account_access": [
        "I've tried Chrome, Firefox and the app.",
        "I cleared cookies and the cache, no difference.",
        "It worked fine until {date}.",
        "My username is {first_ascii}{n}.",
    ],
    "cancel_subscription": [
        "I've been a member since {year}.",
        "It's nothing personal, I just don't use it enough.",
        "Please confirm in writing once it's done.",
        "Money is a bit tight at the moment.",
    ],
    "product_question": [
        "I'm thinking of buying two as gifts.",
        "I couldn't find this in the FAQ.",
        "I'm just trying to decide before the sale ends.",
        "I'm asking because my old one broke after a year.",
    ],
    "change_address": [
        "The old place is {street2}.",
        "I'll be there from {date}.",
        "The buzzer says '{last}'.",
    ],
    "complaint": [
        "I've been a loyal customer for years.",
        "I'll be telling friends to shop elsewhere.",
        "I expect a proper reply from a manager, not a template.",
        "I'm writing this so there's a record of it.",
    ],
}

DISTRACT = {
    "order_status": [
        "If it hasn't left yet I might need to change the delivery address.",
        "Shipping was meant to be 2-3 days.",
        "I have a question about the tracking too.",
        "Is there a delay at the warehouse?",
        "I can see the payment on my account already.",
    ],
    "refund_request": [
        "This is for order {order}.",
        "I'd also like the shipping cost back.",
        "The item was fine, I just changed my mind.",
        "The product just wasn't for me.",
        "My bank account still shows the full charge.",
    ],
    "billing_issue": [
        "The charge is for my {plan} subscription.",
        "It's the same on my account page.",
        "Is this related to order {order}?",
        "If this can't be fixed I want the money refunded.",
        "I also have a question about how the VAT is worked out.",
    ],
    "shipping_delay": [
        "It's order {order}.",
        "Can you at least tell me the order status?",
        "If it doesn't come by Friday I'd like to cancel.",
        "I hope the {product} isn't damaged after all this time.",
        "Maybe it went to my old address?",
    ],
    "damaged_item": [
        "This was order {order}.",
        "Do I need to send the product back first?",
        "I'd rather have a refund than wait for a new one.",
        "It's not the first time, so take this as a complaint as well.",
        "I have a question about the warranty too.",
    ],
    "account_access": [
        "I need to check the status of a purchase.",
        "I'm also trying to change my email address.",
        "The {plan} subscription is still being charged even though I can't get in.",
        "I just want to see my order history.",
    ],
    "cancel_subscription": [
        "Will I get a refund for the unused months?",
        "Also, please close the whole account.",
        "My last order can still go out.",
        "There's no button for it on the account page.",
    ],
    "product_question": [
        "If I buy it, how soon would the order arrive?",
        "What are the shipping costs to {country}?",
        "Could I get a refund if it doesn't fit?",
        "Does it come with any accessories?",
    ],
    "change_address": [
        "It hasn't shipped yet according to the email.",
        "This is for order {order}.",
        "Same goes for my subscription deliveries.",
        "I tried to do it on the account page but the field is greyed out.",
    ],
    "complaint": [
        "It all started with order {order}.",
        "The original issue was a missing parcel.",
        "I asked for a refund and got ignored.",
        "Then the delivery was delayed again.",
        "Every item I've bought this year had a problem.",
    ],
}

# Neutral banks: no label keyword of any field in any of these.
GENERIC = [
    "Thanks for your help.",
    "Hope you can sort this out.",
    "Please get back to me when you can.",
    "I've already looked through the help centre.",
    "My email is {email}.",
    "You can reach me on {phone}.",
    "This is the second time I'm writing about this.",
    "Thanks in advance.",
    "I did read the FAQ first.",
    "Let me know if you need anything else from me.",
]
TIER_EXTRA = {
    "free": [],
    "plus": [
        "I'm a Plus member, if that makes any difference.",
        "I pay for Plus, so I expected better.",
    ],
    "business": [
        "We buy for the whole office, so this affects a team of {n}.",
        "Please reply to this email, our shared inbox is read by several people.",
    ],
}
GREETINGS = {
    "email": [
        "Hi,",
        "Hello,",
        "Hi there,",
        f"Dear {STORE} team,",
        "Good morning,",
        "Hey,",
        "Hallo,",
        "Bonjour,",
        "Hi {agent},",
        "Good afternoon,",
    ],
    "chat": ["hi", "hello", "hey there", "Hi!", "hiya", "Good evening"],
    "business": [f"Dear {STORE} team,", "To whom it may concern,", "Good morning,", "Hello,"],
}
SIGNOFFS = {
    "free": [
        "Thanks,\n{name}",
        "Cheers,\n{first}",
        "Thank you!\n{first}",
        "Best,\n{name}",
        "Merci,\n{name}",
        "- {first}",
        "Thanks\n{first}\n\nSent from my phone",
    ],
    "plus": [
        "Best regards,\n{name}",
        "Thanks,\n{name}",
        "Kind regards,\n{name}",
        "Cheers,\n{first}",
        "Many thanks,\n{first}",
    ],
    "business": [
        "Kind regards,\n{name}\n{company}",
        "Best regards,\n{name}\nOffice manager, {company}",
        "Regards,\n{name} ({company})",
    ],
}
URGENT_PREFIXES = ["URGENT: ", "Urgent - ", "[URGENT] "]
URGENT_SENTENCES = [
    "This is urgent.",
    "Please treat this as urgent.",
    "I need this sorted urgently.",
    "It's urgent, I need it by {date_ahead}.",
    "Urgent please, it's for my daughter's birthday tomorrow.",
    "Really urgent, I'm travelling on {date_ahead}.",
]
URGENT_PLAIN = [
    "I need this sorted today!",
    "Please reply ASAP.",
    "I need an answer by tomorrow morning at the latest.",
    "Please, this can't wait.",
]
LOW_SENTENCES = [
    "No rush on this.",
    "Whenever you get a chance.",
    "Low priority, just curious.",
    "Not a big deal, just thought you should know.",
    "It's low priority, take your time.",
    "No hurry at all.",
    "No need to reply quickly.",
]
EMOJI = ["🙏", "😡", "😕", "📦", "👍", "🙄", "😤", "🤞", "😊"]
STARS = ["★☆☆☆☆", "★★☆☆☆", "★★★☆☆", "1/5", "2 stars.", "One star until this is fixed."]

STORY = [
    "I've been shopping with you for about four years and never had a problem before.",
    "My partner told me to let it go, but it's the principle of the thing.",
    "I work shifts, so I can't stay home all day waiting for a courier.",
    "When I rang, the hold music played for forty minutes before anyone picked up.",
    "The first person I spoke to was friendly and promised to call back the next day.",
    "That call never came.",
    "I then used the web chat, where I was passed between three different people.",
    "Each of them asked me to explain everything again from the beginning.",
    "I was told the case had been escalated, but nobody could give me a reference number.",
    "I'm a reasonable person and I know mistakes happen.",
    "What bothers me is that nobody seems to take responsibility.",
    "I have kept copies of every email and the chat logs.",
    "My neighbour had almost the same experience last month.",
    "I have recommended you to friends and family in the past.",
    "At this point I've spent more time on this than the {product} is worth.",
    "I would like someone senior to look at the whole history.",
    "Please read the whole thing before replying with a template.",
    "The tracking page said one thing and your agent said another.",
    "I took a day off work on {date} because I was told it would arrive that day.",
    "Nothing turned up and nobody let me know.",
    "I have been patient, but my patience is running out.",
    "To be fair, the {product2} I got last spring was great.",
    "Your website says you answer within 24 hours; it has been {days} days.",
    "I'm not asking for anything unreasonable.",
    "If I don't hear back this week I'll dispute it with my bank.",
    "English isn't my first language, so sorry for any mistakes.",
    "Here is exactly what happened, day by day.",
    "On {date} I got an email saying everything was fine.",
    "Two days later I got another email saying the opposite.",
    "I don't understand how both can be true.",
    "The chat agent, {agent}, was polite but couldn't do anything.",
    "She said she'd pass it on to a specialist team.",
    "A week later I got a satisfaction survey, which felt like a joke.",
    "I gave it one star and explained why.",
    "I'm happy to send photos, receipts, anything you need.",
    "My phone number is on file if that's easier.",
    "I'd rather sort this out with you than leave a public review.",
    "Thank you for taking the time to read all of this.",
    "I run a small household on a tight budget, so every euro matters.",
    "My kids were really looking forward to it, which makes it worse.",
    "I've read your terms and conditions twice to make sure I'm not missing anything.",
    "The automatic emails keep telling me to check the FAQ, which I have.",
    "Sorry for the long message, but I want you to have the full picture.",
]
AGENT_LINES = [
    f"Thank you for getting in touch with {STORE}.",
    "I'm sorry to hear about this and I fully understand your frustration.",
    "I've passed your case to the team that handles this, and they will reply within 48 hours.",
    "Could you please confirm your full name and postcode so I can verify your details?",
    "I can see the case on our side and it's being looked at.",
    "Unfortunately I'm not able to give a firm date at the moment.",
    "Please allow 5-7 working days for this to be processed.",
    "If there is anything else I can help with, just reply to this email.",
    "Your case reference is CS-{num}.",
    "We apologise for the inconvenience caused.",
    "I've added a note to your file so any colleague can pick this up.",
    "Our warehouse team has confirmed they are investigating.",
    "Thank you for your patience while we look into this.",
    "I have checked with the courier and I'm waiting for their reply.",
]
CHAT_OPEN = [
    "Hi, thanks for waiting, my name is {agent}. How can I help today?",
    "Hello, you're chatting with {agent}. What can I do for you?",
    "Good day, {agent} here. How can I help?",
]
CHAT_CLOSE = [
    "I'm going to close this chat as it's been quiet for a while.",
    f"Thanks for chatting with {STORE}, have a lovely day!",
    "Is there anything else I can help with today?",
]
CHAT_AGENT = [
    "Let me look into that for you, one moment please.",
    "Thank you for your patience.",
    "I can see the case here.",
    "I'm checking with my colleagues now.",
    "Could you confirm the email on file for me?",
    "I understand, and I'm sorry for the trouble.",
    "I'm afraid I can't see any more detail on my side.",
    "I've added a note to the case.",
    "I'll escalate this to the team that deals with it.",
    "They usually reply within two working days.",
    "Are you still there?",
    "I can't promise anything, but I'll do my best.",
]
CHAT_CUSTOMER = [
    "Hi, I'm writing about the same problem as last time.",
    "I already explained this yesterday.",
    "Yes, still here.",
    "Sure, it's {email}.",
    "How long will that take?",
    "That's what the last person said too.",
    "Can I speak to someone senior?",
    "OK.",
    "No, that doesn't help.",
    "I've been waiting for {days} days now.",
    "Please don't close the chat, I'm typing.",
    "Fine, thanks.",
    "Is there a phone number I can call instead?",
    "Can you put that in writing?",
]
LOG_LINES = [
    "INFO  [http] GET /api/v3/cart -> 200 ({ms} ms)",
    "INFO  [http] GET /api/v3/home/feed -> 200 ({ms} ms)",
    "WARN  [http] POST /api/v3/session/refresh -> 401 ({ms} ms)",
    "WARN  [auth] token refresh failed, retry {try}/5 in {ms} ms",
    "INFO  [auth] session {hex} expired, clearing local credentials",
    "DEBUG [sync] websocket closed: code=1006 reason=''",
    "DEBUG [db] loaded {n} records from local db in {ms} ms",
    "INFO  [push] registration ok, device={hex}",
    "DEBUG [ui] render HomeScreen took {ms} ms",
    "WARN  [cache] memory warning, trimming image cache to {n} MB",
    "INFO  [net] network switched: wifi -> cellular",
    "INFO  [net] network switched: cellular -> wifi",
    "DEBUG [http] retrying call {hex} (attempt {try}/5)",
    "DEBUG [http] GET /static/img/{hex}.webp -> 304 ({ms} ms)",
    "DEBUG [config] feature flags refreshed: {n} flags, etag={hex}",
    "DEBUG [analytics] batch flushed: {n} events",
    "INFO  [ui] deep link opened: brightbasket://home",
    "INFO  [http] GET /api/v3/recommendations?page={try} -> 200 ({ms} ms)",
    "DEBUG [db] migration check ok (schema {n})",
    "DEBUG [net] TLS handshake with api.brightbasket.example took {ms} ms",
    "ERROR [http] GET /api/v3/profile -> 401 ({ms} ms)",
    "ERROR [ui] unhandled 401 on HomeScreen, showing sign-in sheet",
]
LOG_LINES_BY_INTENT = {
    "account_access": [
        "ERROR [http] POST /api/v3/account/login -> 401 ({ms} ms)",
        "WARN  [auth] access denied for user_id={num}: mfa_required",
        "WARN  [auth] mfa code rejected (attempt {try}/5)",
    ],
    "billing_issue": [
        "ERROR [http] POST /api/v3/billing/charge -> 409 ({ms} ms)",
        "INFO  [payments] payment intent {hex} -> requires_action",
        "WARN  [payments] 3DS challenge dismissed, intent={hex}",
        "ERROR [payments] card declined: code=do_not_honor",
    ],
}
TABLE_NOTES = {
    "billing_issue": [
        "charged twice",
        "invoice total differs",
        "VAT line missing",
        "paid, shows unpaid",
    ],
    "shipping_delay": [
        "late ({n} days)",
        "still in transit",
        "stuck at depot",
        "delivered a week late",
    ],
    "order_status": [
        "not dispatched yet",
        "no tracking",
        "awaiting confirmation",
        "no email received",
    ],
}
TABLE_NEUTRAL_NOTES = [
    "",
    "",
    "",
    "",
    "signed by reception",
    "left at gate",
    "ok",
    "partial, rest followed",
    "wrong size, swapped",
    "ok, slightly late",
]

CATEGORIES = {
    "kitchen": [
        "cast iron skillet",
        "glass pour-over kettle",
        "stoneware dinner plates (set of 6)",
        "bamboo cutting board",
        "blender",
        "waffle maker",
        "insulated water bottle",
    ],
    "gadget": [
        "Aurora desk lamp",
        "Breva burr coffee grinder",
        "Kestrel wireless earbuds",
        "smart plug 2-pack",
        "air purifier",
        "over-ear headphones",
        "electric toothbrush",
        "robot vacuum",
        "LED string lights",
        "USB-C charging dock",
        "wall clock",
    ],
    "clothing": [
        "trail running shoes",
        "kids' rain jacket",
        "wool winter coat",
        "rain boots",
        "bike helmet",
        "linen shirt",
    ],
    "textile": [
        "merino wool throw",
        "linen duvet cover (king)",
        "silk pillowcase",
        "weekend duffel bag",
        "dog bed (large)",
    ],
    "food": [
        "Café Noir espresso beans (1 kg)",
        "tea sampler box",
        "organic Müsli (750 g)",
        "olive oil tin (1 l)",
        "dark chocolate gift box",
    ],
    "furniture": [
        "ergonomic office chair",
        "standing desk frame",
        "oak bedside table",
        "bar stools (set of 2)",
    ],
    "breakable": [
        "Aurora desk lamp",
        "ceramic planter",
        "glass pour-over kettle",
        "stoneware dinner plates (set of 6)",
        "wall clock",
        "blender",
        "Müsli storage jars",
    ],
}
_OTHER_PRODUCTS = [
    "hiking backpack 30L",
    "children's puzzle set",
    "e-reader cover",
    "sunglasses",
    "crème brûlée torch",
    "cork yoga mat",
]
PRODUCTS = sorted({p for ps in CATEGORIES.values() for p in ps} | set(_OTHER_PRODUCTS))
OFFICE_PRODUCTS = [
    "A4 paper, 10 reams",
    "printer toner (black)",
    "coffee beans 6 kg",
    "paper towels x24",
    "dishwasher tablets x200",
    "whiteboard markers",
    "oat milk x12",
    "bin bags x100",
]
FIRST_NAMES = [
    "José",
    "Zoë",
    "Søren",
    "Małgorzata",
    "François",
    "Björn",
    "Chloé",
    "Núria",
    "Siobhán",
    "Anna",
    "Tom",
    "Priya",
    "Kwame",
    "Lucía",
    "Mehmet",
    "Aoife",
    "Yuki",
    "Daniel",
    "Fatima",
    "Olivier",
    "Grace",
    "Inês",
    "Mateus",
    "Hannah",
    "Rafael",
    "Emma",
    "Jürgen",
    "Noor",
    "Liam",
    "Ana",
]
LAST_NAMES = [
    "García",
    "Müller",
    "Nowak",
    "O'Brien",
    "Lindqvist",
    "Dubois",
    "Okafor",
    "Rossi",
    "Kowalczyk",
    "Smith",
    "Andersen",
    "Fernández",
    "Yılmaz",
    "Brown",
    "Novák",
    "Jensen",
    "Moreau",
    "Patel",
    "Schmidt",
    "Costa",
]
COMPANIES = [
    "Nordlicht GmbH",
    "Café Rosa Ltd",
    "Oakridge Dental",
    "Pinecone Studio",
    "Halvorsen & Berg AS",
    "Little Acorn Nursery",
    "Marée Bistro",
    "Tandem Cycles",
]
AGENTS = ["Mia", "Tomás", "Priya", "Ahmed", "Lena", "Sam", "Jonas"]
CARRIERS = ["DHL", "UPS", "Royal Mail", "PostNL", "DPD", "Hermes", "La Poste", "GLS", "InPost"]
CITIES = [
    "Lyon",
    "Kraków",
    "Malmö",
    "Zürich",
    "Bristol",
    "Leeds",
    "Porto",
    "Utrecht",
    "Sevilla",
    "Gdańsk",
    "Köln",
    "Dublin",
    "Aarhus",
    "Bologna",
]
STREETS = [
    "Rue des Lilas",
    "Calle Mayor",
    "Kastanienallee",
    "Elm Grove",
    "ul. Długa",
    "Storgatan",
    "Via Roma",
    "Keizersgracht",
    "Mill Lane",
    "Rua das Flores",
    "Søndergade",
    "Park Road",
]
COUNTRIES = [
    "Germany",
    "France",
    "Spain",
    "Poland",
    "the Netherlands",
    "Ireland",
    "Sweden",
    "Italy",
    "Portugal",
    "Belgium",
]
DEVICES = [
    "an iPhone 15",
    "a Pixel 8",
    "a MacBook Air",
    "an older Android phone",
    "a Samsung tablet",
    "Windows 11",
]
PLANS = {
    "free": ["monthly coffee box", "snack box", "fortnightly fruit box"],
    "plus": ["Plus membership", f"{STORE} Plus", "annual Plus plan"],
    "business": ["Business plan", "office supplies box", "team plan"],
}
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]

# --------------------------------------------------------------------------------------------
# The emulator's rule, re-implemented here so the data can be checked against it.
# --------------------------------------------------------------------------------------------

_WORD = re.compile(r"[^\W\d_]+")


def label_keywords(value: str) -> list[str]:
    """A label's keywords: the value split on '_' and '-', parts of at least 3 letters."""
    return [part for part in re.split(r"[_-]", value) if len(part) >= 3]


def label_scores(text: str, values: Sequence[str]) -> dict[str, int]:
    """The rule's score of each value: (keyword, word) pairs where the word starts with the
    keyword's first min(5, len) characters."""
    words = _WORD.findall(text.lower())
    scores = {}
    for value in values:
        prefixes = [k[: min(5, len(k))] for k in label_keywords(value)]
        scores[value] = sum(1 for p in prefixes for w in words if w.startswith(p))
    return scores


def rule_credit(text: str, values: Sequence[str], truth: str) -> float:
    """Expected accuracy of the rule on one message: ties are broken at random, so a tie that
    includes the truth scores 1/len(tie)."""
    scores = label_scores(text, values)
    best = max(scores.values())
    tied = [v for v, s in scores.items() if s == best]
    return 1.0 / len(tied) if truth in tied else 0.0


def rule_pick(text: str, values: Sequence[str], rng: random.Random) -> str:
    """What the rule answers for `text`, ties broken with `rng`."""
    scores = label_scores(text, values)
    best = max(scores.values())
    return rng.choice([v for v, s in scores.items() if s == best])


USER_TEMPLATE = "Channel: {channel}\n\n{text}"


def rendered_user_message(channel: str, body: str) -> str:
    """The user message the model sees for a whole (unchunked) row, as the job file renders it."""
    return USER_TEMPLATE.format(channel=channel, text=body)


def normalized(text: str) -> str:
    """Whitespace- and case-insensitive form of a body, the key for near-duplicates."""
    return " ".join(text.split()).casefold()


# --------------------------------------------------------------------------------------------
# Filling slots.
# --------------------------------------------------------------------------------------------

_SLOT = re.compile(r"\{(\w+)\}")


_TRANSLIT = str.maketrans({"ł": "l", "Ł": "L", "ø": "o", "Ø": "O", "ı": "i", "ß": "ss", "æ": "ae"})


def _ascii(text: str) -> str:
    folded = (
        unicodedata.normalize("NFKD", text.translate(_TRANSLIT)).encode("ascii", "ignore").decode()
    )
    return re.sub(r"[^A-Za-z]", "", folded).lower()


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class Slots:
    """Slot values for one message: the first use of a name draws a value, later uses repeat it."""

    def __init__(self, rng: random.Random, tier: str, received: date):
        self.rng = rng
        self.tier = tier
        self.received = received
        self.values: dict[str, str] = {}
        self.used: set[str] = set()  # templates already in this message, not to be repeated
        self.currency = rng.choices(["€", "£", "$"], weights=[55, 20, 25])[0]
        self.comma_decimal = self.currency == "€" and rng.random() < 0.4

    def fill(self, template: str) -> str:
        return _SLOT.sub(lambda m: self.get(m.group(1)), template)

    def fill_fresh(self, template: str) -> str:
        """Fill every slot with a new value (log lines and tables, where values vary by line)."""
        return _SLOT.sub(lambda m: self.fresh(m.group(1).rstrip("0123456789")), template)

    def get(self, name: str) -> str:
        if name in CATEGORIES and name not in self.values:
            # a sentence about, say, dishwashers names a kitchen product; keep the message's
            # product if it is one, and make it the message's product otherwise
            current = self.values.get("product")
            if current not in CATEGORIES[name]:
                current = self.rng.choice(CATEGORIES[name])
            self.values[name] = current
            self.values.setdefault("product", current)
        if name not in self.values:
            base = name.rstrip("0123456789")
            value = self.fresh(base)
            if base != name:  # product2 and the like differ from product
                while value == self.values.get(base):
                    value = self.fresh(base)
            self.values[name] = value
        return self.values[name]

    def fresh(self, base: str) -> str:
        """A new value for the slot kind `base`, not remembered."""
        rng = self.rng
        makers: dict[str, Callable[[], str]] = {
            "product": lambda: rng.choice(PRODUCTS),
            **{c: (lambda c=c: rng.choice(CATEGORIES[c])) for c in CATEGORIES},
            "office": lambda: rng.choice(OFFICE_PRODUCTS),
            "amount": self.amount,
            "date": self.past_date,
            "date_ahead": self.future_date,
            "days": lambda: str(rng.randint(6, 24)),
            "n": lambda: str(rng.randint(2, 60)),
            "try": lambda: str(rng.randint(1, 5)),
            "num": lambda: str(rng.randint(10000, 99999)),
            "ms": lambda: str(rng.choice([rng.randint(12, 400), rng.randint(400, 9000)])),
            "hex": lambda: f"{rng.randrange(16**8):08x}",
            "year": lambda: str(rng.randint(2017, 2025)),
            "order": self.order_number,
            "tracking": lambda: rng.choice(
                [
                    f"1Z{rng.randrange(16**10):010X}",
                    f"JJD{rng.randrange(10**12):012d}",
                    f"{rng.randrange(10**9):09d}GB",
                ]
            ),
            "carrier": lambda: rng.choice(CARRIERS),
            "city": lambda: rng.choice(CITIES),
            "street": lambda: f"{rng.randint(1, 140)} {rng.choice(STREETS)}",
            "postcode": lambda: rng.choice(
                [
                    str(rng.randint(10000, 99999)),
                    f"BS{rng.randint(1, 16)} {rng.randint(1, 9)}"
                    f"{rng.choice('ABDEFGHJLNPQRSTUWXYZ')}{rng.choice('ABDEFGHJLNPQRSTUWXYZ')}",
                    f"{rng.randint(1000, 9999)} {rng.choice('ABCDEFGHJKLMNPRSTVWXZ')}"
                    f"{rng.choice('ABCDEFGHJKLMNPRSTVWXZ')}",
                ]
            ),
            "country": lambda: rng.choice(COUNTRIES),
            "device": lambda: rng.choice(DEVICES),
            "card": lambda: (
                f"{rng.choice(['card', 'Visa', 'Mastercard', 'debit card'])} ending "
                f"{rng.randint(1000, 9999)}"
            ),
            "plan": lambda: rng.choice(PLANS[self.tier]),
            "first": lambda: rng.choice(FIRST_NAMES),
            "last": lambda: rng.choice(LAST_NAMES),
            "first_ascii": lambda: _ascii(self.get("first")),
            "name": lambda: f"{self.get('first')} {self.get('last')}",
            "email": lambda: (
                f"{_ascii(self.get('first'))}.{_ascii(self.get('last'))}"
                f"@{rng.choice(['example.com', 'example.net', 'example.org'])}"
            ),
            "phone": lambda: (
                f"+{rng.choice(['33', '44', '49', '48', '34', '31'])} "
                f"{rng.randint(100, 999)} {rng.randint(100, 999)} {rng.randint(1000, 9999)}"
            ),
            "company": lambda: rng.choice(COMPANIES),
            "agent": lambda: rng.choice(AGENTS),
        }
        return makers[base]()

    def amount(self) -> str:
        value = self.rng.choice([self.rng.randint(5, 60), self.rng.randint(60, 400)])
        cents = self.rng.choice([0, 0, 49, 90, 95, 99, self.rng.randint(1, 99)])
        if self.comma_decimal:
            return f"{value},{cents:02d} €"
        return f"{self.currency}{value}.{cents:02d}"

    def order_number(self) -> str:
        digits = self.rng.randint(100000, 999999)
        return self.rng.choice([f"#BB-{digits}", f"BB{digits}", f"#{digits}"])

    def date_ago(self, days: int) -> str:
        """The date `days` before the message was received, in a random everyday format."""
        return self._format_date(self.received - timedelta(days=days), ago=days)

    def past_date(self) -> str:
        day = self.received - timedelta(days=self.rng.randint(1, 25))
        return self._format_date(day, ago=(self.received - day).days)

    def future_date(self) -> str:
        day = self.received + timedelta(days=self.rng.randint(1, 6))
        return self._format_date(day, ago=None)

    def _format_date(self, day: date, ago: int | None) -> str:
        choices = [
            f"{MONTHS[day.month - 1]} {day.day}",
            f"{day.day} {MONTHS[day.month - 1]}",
            f"the {_ordinal(day.day)}",
            f"{day.day:02d}/{day.month:02d}",
            day.isoformat(),
        ]
        if ago is not None and ago <= 6:
            choices.append(f"last {WEEKDAYS[day.weekday()]}")
        if ago is None:
            choices.append(WEEKDAYS[day.weekday()])
        return self.rng.choice(choices)


# --------------------------------------------------------------------------------------------
# Composing messages.
# --------------------------------------------------------------------------------------------


def _pick(rng: random.Random, weights: dict[str, int]) -> str:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def _urgency_sentence(rng: random.Random, urgency: str) -> tuple[str | None, str | None]:
    """(prefix, sentence) that carry the urgency, either or both None."""
    if urgency == "urgent":
        if rng.random() < URGENT_CUE_RATE:
            if rng.random() < 0.4:
                return rng.choice(URGENT_PREFIXES), None
            return None, rng.choice(URGENT_SENTENCES)
        return None, rng.choice(URGENT_PLAIN)
    if urgency == "low" and rng.random() < LOW_PHRASE_RATE:
        return None, rng.choice(LOW_SENTENCES)
    return None, None


def intent_sentences(
    rng: random.Random, slots: Slots, intent: str, urgency: str, tier: str, max_extra: int
) -> tuple[str | None, list[str]]:
    """The sentences that carry the intent and urgency of one message, in reading order, and
    an optional prefix such as 'URGENT: ' for the first of them."""
    has_cue = rng.random() < CUE_RATE
    sentences = [rng.choice(CUE[intent] if has_cue else PLAIN[intent])]
    n_extra = rng.choices(range(max_extra + 1), weights=[5, 4, 2, 1][: max_extra + 1])[0]
    pool = PLAIN[intent] + DETAIL[intent] + DETAIL[intent] + GENERIC + TIER_EXTRA[tier]
    for _ in range(n_extra):
        candidate = rng.choice(pool)
        if candidate not in sentences:
            sentences.append(candidate)
    if has_cue and rng.random() < SECOND_CUE_RATE:
        candidate = rng.choice(CUE[intent])
        if candidate not in sentences:
            sentences.insert(rng.randint(1, len(sentences)), candidate)
    if rng.random() < DISTRACTOR_RATE:
        sentences.insert(rng.randint(1, len(sentences)), rng.choice(DISTRACT[intent]))
    prefix, closing = _urgency_sentence(rng, urgency)
    if closing:
        sentences.append(closing)
    slots.used.update(sentences)
    return prefix, [slots.fill(s) for s in sentences]


def _add_typo(rng: random.Random, text: str) -> str:
    words = list(re.finditer(r"[A-Za-z]{5,}", text))
    if not words:
        return text
    match = rng.choice(words)
    word, i = match.group(), rng.randrange(1, len(match.group()) - 2)
    kind = rng.randrange(3)
    if kind == 0:
        word = word[:i] + word[i + 1] + word[i] + word[i + 2 :]
    elif kind == 1:
        word = word[:i] + word[i + 1 :]
    else:
        word = word[:i] + word[i] + word[i:]
    return text[: match.start()] + word + text[match.end() :]


def compose_short(
    rng: random.Random, intent: str, urgency: str, channel: str, tier: str, received: date
) -> str:
    """A message of one to about five sentences, styled for its channel."""
    slots = Slots(rng, tier, received)
    max_extra = {"email": 3, "web_form": 2, "chat": 1, "app_review": 1}[channel]
    prefix, sentences = intent_sentences(rng, slots, intent, urgency, tier, max_extra)
    if prefix:
        sentences[0] = prefix + sentences[0]

    if channel == "email":
        paragraphs = [" ".join(sentences)]
        if len(sentences) >= 4 and rng.random() < 0.5:
            cut = rng.randint(2, len(sentences) - 1)
            paragraphs = [" ".join(sentences[:cut]), " ".join(sentences[cut:])]
        greetings = GREETINGS["business"] if tier == "business" else GREETINGS["email"]
        if rng.random() < 0.85:
            paragraphs.insert(0, slots.fill(rng.choice(greetings)))
        if rng.random() < 0.8:
            paragraphs.append(slots.fill(rng.choice(SIGNOFFS[tier])))
        text = "\n\n".join(paragraphs)
    elif channel == "web_form":
        text = " ".join(sentences)
        if rng.random() < 0.4:
            text += "\n" + slots.fill(rng.choice(SIGNOFFS[tier]))
    elif channel == "chat":
        if rng.random() < 0.4:
            sentences.insert(0, rng.choice(GREETINGS["chat"]))
        text = " ".join(sentences)
        if rng.random() < 0.2:
            text = text.lower()
        if rng.random() < 0.15:
            text += " " + rng.choice(EMOJI)
    else:  # app_review
        text = " ".join(sentences)
        if rng.random() < 0.5:
            text += " " + rng.choice(STARS)
        if rng.random() < 0.3:
            text += " " + rng.choice(EMOJI)

    if rng.random() < TYPO_RATE:
        for _ in range(rng.randint(1, 2)):
            text = _add_typo(rng, text)
    return text


def _wrap_email(rng: random.Random, slots: Slots, tier: str, paragraphs: list[str]) -> str:
    greetings = GREETINGS["business"] if tier == "business" else GREETINGS["email"]
    head = [slots.fill(rng.choice(greetings))] if rng.random() < 0.9 else []
    tail = [slots.fill(rng.choice(SIGNOFFS[tier]))]
    return "\n\n".join(head + paragraphs + tail)


def _story_paragraph(rng: random.Random, slots: Slots, intent: str) -> str:
    fresh = [s for s in STORY if s not in slots.used]
    if len(fresh) < 6:  # a very long story has told everything once; start again
        slots.used.difference_update(STORY)
        fresh = list(STORY)
    sentences = rng.sample(fresh, rng.randint(3, 6))
    unused = [s for s in PLAIN[intent] + DETAIL[intent] if s not in slots.used]
    if unused and rng.random() < 0.5:
        sentences.insert(rng.randint(0, len(sentences)), rng.choice(unused))
    slots.used.update(sentences)
    return slots.fill(" ".join(sentences))


def _words(paragraphs: list[str]) -> int:
    return sum(len(p.split()) for p in paragraphs)


def compose_long(rng: random.Random, intent: str, urgency: str, tier: str, received: date) -> str:
    """An email of several paragraphs (300-1,000 words): a long story, a pasted purchase history,
    or a reply with the earlier thread quoted below it."""
    slots = Slots(rng, tier, received)
    target = rng.randint(320, 900)
    kind = rng.choices(["story", "history", "thread"], weights=[4, 3, 3])[0]
    prefix, opening = intent_sentences(rng, slots, intent, urgency, tier, max_extra=3)
    if prefix:
        opening[0] = prefix + opening[0]
    paragraphs = [" ".join(opening)]

    if kind == "story":
        while _words(paragraphs) < target - 40:
            paragraphs.append(_story_paragraph(rng, slots, intent))
        closing = [s for s in CUE[intent] + PLAIN[intent] if s not in slots.used]
        paragraphs.append(slots.fill(rng.choice(closing) + " " + rng.choice(GENERIC)))
        return _wrap_email(rng, slots, tier, paragraphs)

    if kind == "history":
        paragraphs.append(_story_paragraph(rng, slots, intent))
        rows, ago, size = [], rng.randint(0, 6), _words(paragraphs) + 20
        while size < target - 60:
            recent = ["In transit", "Awaiting dispatch", "Delivered"]
            older = ["Delivered", "Delivered", "Delivered", "Returned", "Delivered (late)"]
            state = rng.choice(recent if ago < 8 else older)
            day = received - timedelta(days=ago)
            rows.append(
                f"{day.isoformat()}  {slots.order_number():<11}  {slots.fresh('product'):<34}  "
                f"{slots.amount():<9}  {state}"
            )
            size += len(rows[-1].split())
            ago += rng.randint(1, 7)
        header = "Date        Reference    Description                         Total      Delivery"
        lines = ["Everything I've bought from you in recent months, copied from the website:", ""]
        paragraphs.append("\n".join(lines + [header] + rows[::-1]))
        while _words(paragraphs) < target:
            paragraphs.append(_story_paragraph(rng, slots, intent))
        return _wrap_email(rng, slots, tier, paragraphs)

    # thread: the new message on top, the earlier exchange quoted below, deeper each step back
    paragraphs.append(_story_paragraph(rng, slots, intent))
    text = _wrap_email(rng, slots, tier, paragraphs)
    depth, ago = 1, 0
    while len(text.split()) < target:
        ago += rng.randint(1, 4)
        when = slots.date_ago(ago)
        if depth % 2:
            header = f"On {when}, {STORE} Support <support@brightbasket.example> wrote:"
            reply = [f"Dear {slots.get('first')},", ""]
            reply.append(slots.fill(" ".join(rng.sample(AGENT_LINES, rng.randint(3, 5)))))
            reply += ["", f"Kind regards,\n{slots.get('agent')}\n{STORE} Customer Care"]
            quoted_text = "\n".join(reply)
        else:
            header = f"On {when}, {slots.get('name')} <{slots.get('email')}> wrote:"
            quoted_text = _story_paragraph(rng, slots, intent)
        quote = "> " * depth
        quoted = "\n".join((quote + line).rstrip() for line in quoted_text.split("\n"))
        text += "\n\n" + ("> " * (depth - 1) + header).rstrip() + "\n" + quoted
        depth += 1
    return text


# Characters per o200k token for each kind of pasted text, measured with `--check`.
CHARS_PER_TOKEN = {"log": 2.47, "table": 2.56, "transcript": 3.3}
HUGE_INTENTS = {
    "log": ["account_access", "billing_issue"],
    "table": ["billing_issue", "shipping_delay", "order_status"],
    "transcript": ["complaint", "refund_request", "shipping_delay", "damaged_item"],
}


def compose_huge(
    rng: random.Random, kind: str, intent: str, urgency: str, tier: str, received: date
) -> str:
    """An email of 3,000-6,000 tokens: a short request with a log, a table or a set of chat
    transcripts pasted under it."""
    slots = Slots(rng, tier, received)
    prefix, opening = intent_sentences(rng, slots, intent, urgency, tier, max_extra=2)
    if prefix:
        opening[0] = prefix + opening[0]
    target_chars = int(rng.randint(3300, 5500) * CHARS_PER_TOKEN[kind])
    paragraphs = [" ".join(opening)]
    if kind == "log":
        paragraphs.append("Your colleague asked me for the app's debug log, so here it is in full.")
        clock = 8 * 3600 + rng.randint(0, 3600 * 10)
        lines = ["----- BEGIN LOG -----"]
        extra = LOG_LINES_BY_INTENT.get(intent, [])
        size = 0
        while size < target_chars:
            clock += rng.randint(0, 40)
            clock_s = f"{clock // 3600 % 24:02d}:{clock // 60 % 60:02d}:{clock % 60:02d}"
            stamp = f"{received.isoformat()}T{clock_s}.{rng.randint(0, 999):03d}Z"
            template = rng.choice(extra) if extra and rng.random() < 0.04 else rng.choice(LOG_LINES)
            lines.append(f"{stamp} {slots.fill_fresh(template)}")
            size += len(lines[-1]) + 1
        lines.append("----- END LOG -----")
        paragraphs.append("\n".join(lines))
    elif kind == "table":
        paragraphs.append(
            "Below is every delivery to our office in recent months, exported from our purchasing "
            "sheet, so you can see the pattern for yourselves."
        )
        rows, ago, size = [], rng.randint(1, 5), 0
        notes = TABLE_NOTES.get(intent, [])
        while size < target_chars:
            day = received - timedelta(days=ago)
            delivered = day + timedelta(days=rng.randint(1, 9))
            if notes and rng.random() < 0.15:
                note = rng.choice(notes)
            else:
                note = rng.choice(TABLE_NEUTRAL_NOTES)
            product = rng.choice([slots.fresh("office"), slots.fresh("product")])
            rows.append(
                (
                    f"{day.isoformat()} | {slots.order_number():<10} | {product[:28]:<28} | "
                    f"{rng.randint(1, 12):>3} | {slots.amount():<10} | "
                    f"{delivered.isoformat() if delivered <= received else '-':<10} | "
                    f"{slots.fill_fresh(note)}"
                ).rstrip()
            )
            size += len(rows[-1]) + 1
            ago += rng.randint(0, 3)
        header = "Date       | Reference  | Contents                     | Qty | Total      | Delivered  | Notes"
        paragraphs.append("\n".join([header] + rows[::-1]))
    else:  # transcript
        paragraphs.append(
            "I've pasted the transcripts of every chat I've had with you about this below, "
            "so nobody can say I didn't explain it."
        )
        sessions: list[tuple[str, list[str]]] = []
        size = 0
        while size < target_chars:
            agent = rng.choice(AGENTS)
            lines = []
            clock = rng.randint(8 * 60, 20 * 60)
            turns = rng.randint(14, 30)
            for turn in range(turns):
                clock += rng.randint(0, 4)
                stamp = f"[{clock // 60 % 24:02d}:{clock % 60:02d}]"
                if turn % 2 == 0:
                    bank = (
                        CHAT_OPEN if turn == 0 else CHAT_CLOSE if turn >= turns - 2 else CHAT_AGENT
                    )
                    said = rng.choice(bank).replace("{agent}", agent)
                    lines.append(f"{stamp} {agent}: {slots.fill_fresh(said)}")
                else:
                    bank = (
                        CUE[intent] + PLAIN[intent] if turn == 1 else CHAT_CUSTOMER + DETAIL[intent]
                    )
                    lines.append(f"{stamp} Me: {slots.fill(rng.choice(bank))}")
                size += len(lines[-1]) + 1
                if size >= target_chars:
                    break
            sessions.append((agent, lines))
        agos = [rng.randint(1, 3)]
        while len(agos) < len(sessions):
            agos.append(agos[-1] + rng.randint(1, 5))
        for number, ((agent, lines), ago) in enumerate(
            zip(sessions, agos[::-1], strict=True), start=1
        ):
            header = f"--- Chat {number} with {agent}, {slots.date_ago(ago)} ---"
            paragraphs.append("\n".join([header] + lines))
    paragraphs.append(slots.fill(rng.choice(GENERIC)))
    return _wrap_email(rng, slots, tier, paragraphs)


# --------------------------------------------------------------------------------------------
# Data sets.
# --------------------------------------------------------------------------------------------


def _random_day(rng: random.Random) -> date:
    return date(2026, 1, 1) + timedelta(days=rng.randint(0, 364))


def _near_variant(rng: random.Random, body: str) -> str:
    """The same body with only whitespace or letter case changed."""
    while True:
        kind = rng.choice(["spaces", "newline", "padding", "upper", "lower"])
        if kind == "spaces":
            gaps = [m.start() for m in re.finditer(" ", body)]
            variant = body
            for pos in sorted(rng.sample(gaps, min(len(gaps), rng.randint(1, 3))), reverse=True):
                variant = variant[:pos] + "  " + variant[pos:]
        elif kind == "newline":
            variant = body + "\n"
        elif kind == "padding":
            variant = " " + body + "  "
        elif kind == "upper":
            variant = body.upper()
        else:
            variant = body.lower()
        if variant != body and normalized(variant) == normalized(body):
            return variant


def build_messages(rng: random.Random) -> list[dict[str, str]]:
    """All message rows with their hidden labels, in message_id order."""
    n_base = N_MESSAGES - N_EXACT_DUPLICATES - N_NEAR_DUPLICATES
    sizes = ["huge"] * N_HUGE + ["long"] * N_LONG + ["short"] * (n_base - N_HUGE - N_LONG)
    rng.shuffle(sizes)
    base: list[dict] = []
    seen: set[str] = set()
    for size in sizes:
        while True:
            tier = _pick(rng, TIERS)
            received = _random_day(rng)
            if size == "short":
                intent = _pick(rng, INTENT_WEIGHTS)
                channel = _pick(rng, CHANNELS)
                kind = "short"
            else:
                channel = rng.choice(["email", "email", "web_form"])
                if size == "long":
                    intent = _pick(rng, INTENT_WEIGHTS)
                    kind = "long"
                else:
                    kind = rng.choice(["log", "log", "table", "transcript", "transcript"])
                    if kind == "table":
                        tier = "business"
                    intent = rng.choice(HUGE_INTENTS[kind])
            urgency = rng.choices(URGENCIES, weights=URGENCY_PRIORS[intent])[0]
            if kind == "short":
                body = compose_short(rng, intent, urgency, channel, tier, received)
            elif kind == "long":
                body = compose_long(rng, intent, urgency, tier, received)
            else:
                body = compose_huge(rng, kind, intent, urgency, tier, received)
            if normalized(body) not in seen:
                break
        seen.add(normalized(body))
        base.append(
            {
                "channel": channel,
                "customer_tier": tier,
                "received": received,
                "body": body,
                "intent": intent,
                "urgency": urgency,
                "size": size,
            }
        )

    rows = list(base)
    # Resends: the same text again a little later, now and then through another channel.
    candidates = [r for r in base if r["size"] != "huge"]
    weights = [1.0 if r["size"] == "short" else 0.45 for r in candidates]
    sources: list[dict] = []
    while len(sources) < N_EXACT_DUPLICATES:
        source = rng.choices(candidates, weights=weights)[0]
        if all(source is not s for s in sources):
            sources.append(source)
    for source in sources:
        copy = dict(source)
        copy["received"] = min(
            source["received"] + timedelta(days=rng.randint(0, 3)), date(2026, 12, 31)
        )
        if rng.random() < 0.3:
            copy["channel"] = rng.choice(["email", "web_form", "chat"])
        rows.append(copy)
    # Near-duplicates: the same short text with different spacing or case.
    bodies = {r["body"] for r in rows}
    shorts = [r for r in base if r["size"] == "short" and all(r is not s for s in sources)]
    for source in rng.sample(shorts, N_NEAR_DUPLICATES):
        variant = _near_variant(rng, source["body"])
        while variant in bodies:
            variant = _near_variant(rng, source["body"])
        bodies.add(variant)
        copy = dict(source, body=variant)
        copy["received"] = min(
            source["received"] + timedelta(days=rng.randint(0, 2)), date(2026, 12, 31)
        )
        rows.append(copy)

    for row in rows:
        row["tiebreak"] = rng.random()
    rows.sort(key=lambda r: (r["received"], r["tiebreak"]))
    out = []
    for i, row in enumerate(rows, start=1):
        out.append(
            {
                "message_id": f"m{i:06d}",
                "channel": row["channel"],
                "customer_tier": row["customer_tier"],
                "received_at": row["received"].isoformat(),
                "body": row["body"],
                "intent": row["intent"],
                "urgency": row["urgency"],
            }
        )
    return out


def build_eval(rng: random.Random, taken: set[str]) -> list[dict[str, str]]:
    """The gold eval set: short messages, an equal number per intent, none of whose bodies
    (up to whitespace and case) appear in `taken`."""
    intents = [intent for intent in INTENTS for _ in range(N_EVAL_PER_INTENT)]
    rng.shuffle(intents)
    seen = set(taken)
    out = []
    for i, intent in enumerate(intents, start=1):
        while True:
            channel = _pick(rng, CHANNELS)
            tier = _pick(rng, TIERS)
            urgency = rng.choices(URGENCIES, weights=URGENCY_PRIORS[intent])[0]
            body = compose_short(rng, intent, urgency, channel, tier, _random_day(rng))
            if normalized(body) not in seen:
                break
        seen.add(normalized(body))
        out.append(
            {
                "eval_id": f"e{i:04d}",
                "channel": channel,
                "customer_tier": tier,
                "body": body,
                "intent": intent,
                "urgency": urgency,
            }
        )
    return out


# --------------------------------------------------------------------------------------------
# The fixed files: schema, prices, job.
# --------------------------------------------------------------------------------------------


def output_schema() -> dict:
    """JSON Schema of one answer, strict-mode compatible (OpenAI structured outputs)."""
    return {
        "title": "support_intent",
        "type": "object",
        "properties": {
            "intent": {
                "type": "string",
                "enum": list(INTENTS),
                "description": "The main reason the customer wrote.",
            },
            "urgency": {
                "type": "string",
                "enum": list(URGENCIES),
                "description": "How soon a person should reply.",
            },
            "summary": {
                "type": "string",
                "maxLength": 200,
                "description": "One sentence, at most 200 characters, saying what the customer wants.",
            },
        },
        "required": ["intent", "urgency", "summary"],
        "additionalProperties": False,
    }


PRICE_COLUMNS = [
    "provider",
    "model",
    "effective_date",
    "input_usd_per_mtok",
    "cached_input_usd_per_mtok",
    "output_usd_per_mtok",
    "batch_discount",
    "source",
]
_OPENAI_SOURCE = "OpenAI API pricing page (standard tier list prices), read 2026-11"
_ANTHROPIC_SOURCE = "Anthropic Claude API pricing page (cache reads as cached input), read 2026-11"
_PROVIDER_NAMES = {"openai": "OpenAI", "anthropic": "Anthropic"}
_REAL_PRICES = [
    ["openai", "gpt-4o-mini", "2026-11-01", "0.15", "0.075", "0.60", "0.5", _OPENAI_SOURCE],
    ["openai", "gpt-4.1-mini", "2026-11-01", "0.40", "0.10", "1.60", "0.5", _OPENAI_SOURCE],
    ["openai", "gpt-4o", "2026-11-01", "2.50", "1.25", "10.00", "0.5", _OPENAI_SOURCE],
    [
        "anthropic",
        "claude-haiku-4-5",
        "2026-11-01",
        "1.00",
        "0.10",
        "5.00",
        "0.5",
        _ANTHROPIC_SOURCE,
    ],
    [
        "anthropic",
        "claude-sonnet-4-5",
        "2026-11-01",
        "3.00",
        "0.30",
        "15.00",
        "0.5",
        _ANTHROPIC_SOURCE,
    ],
]
# The emulator's own rows: each mirrors the real model it stands in for (a job on the emulator
# with `[model] name = "claude-haiku-4-5"` is priced as Anthropic's model), so a dry run shows
# what the real run would cost; labelled as the emulator's, and never billed by anyone.
PRICES = _REAL_PRICES + [
    [
        "emulator",
        *row[1:7],
        f"lowtide emulator prices (never billed): mirror {_PROVIDER_NAMES[row[0]]} {row[1]} "
        "list prices so a dry run shows what the real model would cost",
    ]
    for row in _REAL_PRICES
]

SYSTEM_PROMPT = f"""\
You sort messages sent to the customer-care team of {STORE}, an online shop for home, kitchen and
outdoor goods that also sells a monthly box subscription and a paid Plus membership. Each message
comes with the channel it arrived through: email, chat, web form or app-store review. Read all of
it, including any quoted thread, pasted table or log, and answer with one JSON object that has
exactly three fields.

"intent" is the main reason the customer wrote. Choose exactly one of:
- order_status: asks where a purchase is, whether it went through or when it will be sent, with
  no sign that it is already late.
- refund_request: wants money back for a purchase or a return, or asks when a promised refund
  will arrive.
- billing_issue: a wrong, doubled, unknown or failed charge, or a mistake on an invoice, in VAT
  or in a discounted price.
- shipping_delay: the parcel is on its way but late, stuck, lost by the carrier or rescheduled
  again and again.
- damaged_item: something arrived broken, faulty, wet, scratched or with parts missing.
- account_access: cannot sign in, is locked out, has password or two-factor trouble, or fears
  that someone else got in.
- cancel_subscription: wants to stop, not renew or close a subscription or membership.
- product_question: asks about goods before or after buying: size, material, compatibility,
  stock, care, warranty.
- change_address: wants a delivery or invoice address corrected, or a parcel sent elsewhere.
- complaint: mainly unhappy with the service, the staff or how a case was handled, rather than
  asking for one specific fix.
When several fit, choose what caused the message: a broken delivery is damaged_item even if
the customer also mentions money back, and a late parcel is shipping_delay even if they threaten
to stop buying.

"urgency" is how soon a person should reply. urgent: the customer says it cannot wait, money is
being lost right now, the login may be compromised, or a deadline falls within a day or two.
normal: an ordinary matter for the usual queue. low: a question or remark that can wait, or the
customer says there is no hurry.

"summary" is one plain English sentence of at most 200 characters saying what the customer wants,
keeping any reference number or amount they give. Leave out names, email addresses and phone
numbers. Reply with the JSON object only, no other text."""

JOB_TOML = """\
name = "support-intents"
description = "Label each customer-support message with an intent, an urgency and a one-line summary."

[input]
path = "../support/messages.csv"      # csv, parquet, jsonl/ndjson, or "duckdb:TABLE" (with [input] database = "file.duckdb")
id_column = "message_id"
text_column = "body"
columns = ["channel", "customer_tier", "received_at"]   # extra columns kept next to the output and usable in the template

[chunk]
mode = "split"            # split | truncate
max_tokens = 1024         # budget per unit, counted with the encoding below
overlap_tokens = 64
encoding = "o200k_base"

[prompt]
system = \"\"\"
@SYSTEM@\"\"\"
user_template = "Channel: {channel}\\n\\n{text}"     # {text} is the unit's text; other {names} are input columns

[[prompt.examples]]
user = "Channel: email\\n\\nHello, the kettle that came yesterday has a crack in the handle and leaks when it is full. Could you send another one? Thanks, Marta"
assistant = '{"intent": "damaged_item", "urgency": "normal", "summary": "Kettle delivered yesterday has a cracked handle and leaks; the customer wants a replacement."}'

[[prompt.examples]]
user = "Channel: chat\\n\\nhi, since this morning I cannot get into my profile, the code never comes and I have a delivery to manage today"
assistant = '{"intent": "account_access", "urgency": "urgent", "summary": "Cannot sign in since this morning because the sign-in code never arrives; needs to manage a delivery today."}'

[[prompt.examples]]
user = "Channel: app_review\\n\\nDo the winter boots run small? Thinking of taking a size up. No hurry, just curious."
assistant = '{"intent": "product_question", "urgency": "low", "summary": "Asks whether the winter boots run small and if a size up is advisable."}'

[output]
name = "support_intent"
schema_file = "../schemas/support-intent.json"
# A message longer than [chunk] max_tokens is asked in chunks; its row takes one answer per field:
# intent by majority vote (the default for an enum), urgency the highest any chunk gave (enum
# order), summary the chunks' summaries joined (the default for free text).
reduce = { urgency = "max" }

[model]
backend = "emulator"      # emulator | openai | anthropic | vllm
name = "gpt-4o-mini"
names = { anthropic = "claude-haiku-4-5", vllm = "qwen2.5-7b-instruct" }   # per-backend model ids
temperature = 0.0
max_tokens = 200
extra_body = {}

[qa]
sample_rate = 0.05
seed = 7
eval_set = "../support/eval.csv"
eval_id_column = "eval_id"

[cost]
price_table = "../prices.csv"
budget_usd = 5.0
"""


def job_toml() -> str:
    return JOB_TOML.replace("@SYSTEM@", SYSTEM_PROMPT)


# --------------------------------------------------------------------------------------------
# Writing.
# --------------------------------------------------------------------------------------------


def _csv_text(header: list[str], rows: list[list[str]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buffer.getvalue()


def render_all() -> dict[str, str]:
    """Every generated file as {path relative to the data folder: text}."""
    rng = random.Random(SEED)
    messages = build_messages(rng)
    evals = build_eval(rng, {normalized(m["body"]) for m in messages})
    message_cols = ["message_id", "channel", "customer_tier", "received_at", "body"]
    eval_cols = ["eval_id", "channel", "customer_tier", "body", "intent", "urgency"]
    return {
        "support/messages.csv": _csv_text(
            message_cols, [[m[c] for c in message_cols] for m in messages]
        ),
        "support/labels.csv": _csv_text(
            ["message_id", "intent", "urgency"],
            [[m["message_id"], m["intent"], m["urgency"]] for m in messages],
        ),
        "support/eval.csv": _csv_text(eval_cols, [[e[c] for c in eval_cols] for e in evals]),
        "schemas/support-intent.json": json.dumps(output_schema(), indent=2, ensure_ascii=False)
        + "\n",
        "prices.csv": _csv_text(PRICE_COLUMNS, PRICES),
        "jobs/support-intents.toml": job_toml(),
    }


def write_all(out: Path) -> list[Path]:
    """Write every file under `out`, leaving files whose bytes are already right untouched."""
    written = []
    for relative, text in render_all().items():
        path = out / relative
        data = text.encode("utf-8")
        if path.exists() and path.read_bytes() == data:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written.append(path)
    return written


# --------------------------------------------------------------------------------------------
# Checking.
# --------------------------------------------------------------------------------------------

NEUTRAL_BANKS = {
    "PLAIN": [s for bank in PLAIN.values() for s in bank],
    "DETAIL": [s for bank in DETAIL.values() for s in bank],
    "GENERIC": GENERIC,
    "TIER_EXTRA": [s for bank in TIER_EXTRA.values() for s in bank],
    "GREETINGS": [s for bank in GREETINGS.values() for s in bank],
    "SIGNOFFS": [s for bank in SIGNOFFS.values() for s in bank],
    "STORY": STORY,
    "AGENT_LINES": AGENT_LINES,
    "CHAT_AGENT": CHAT_OPEN + CHAT_AGENT + CHAT_CLOSE,
    "CHAT_CUSTOMER": CHAT_CUSTOMER,
    "LOG_LINES": LOG_LINES,
    "TABLE_NEUTRAL_NOTES": TABLE_NEUTRAL_NOTES,
    "URGENT_PLAIN": URGENT_PLAIN,
    "slot values": PRODUCTS
    + OFFICE_PRODUCTS
    + FIRST_NAMES
    + LAST_NAMES
    + COMPANIES
    + AGENTS
    + CARRIERS
    + CITIES
    + STREETS
    + COUNTRIES
    + DEVICES
    + [p for ps in PLANS.values() for p in ps],
    "template": ["Channel: email", "Channel: chat", "Channel: web_form", "Channel: app_review"],
}


def neutral_bank_hits(samples: int = 5) -> list[tuple[str, str, dict[str, int]]]:
    """Neutral phrases that contain a label keyword once their slots are filled; should be none."""
    rng = random.Random(1)
    labels = list(INTENTS) + list(URGENCIES)
    hits = []
    for bank, phrases in NEUTRAL_BANKS.items():
        for phrase in phrases:
            for _ in range(samples):
                text = Slots(rng, rng.choice(list(TIERS)), date(2026, 6, 15)).fill(phrase)
                found = {k: v for k, v in label_scores(text, labels).items() if v}
                if found:
                    hits.append((bank, text, found))
                    break
    return hits


def _percentiles(values: list[int], points: Sequence[int]) -> dict[int, int]:
    ordered = sorted(values)
    return {p: ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] for p in points}


def check(data_dir: Path) -> None:
    """Print the cue rule's accuracy per field, token-length percentiles and duplicate counts."""
    import polars as pl

    sys.path.insert(0, str(DATA_DIR.parent))
    from lowtide.tokens import count_tokens

    messages = pl.read_csv(data_dir / "support/messages.csv", infer_schema=False)
    labels = pl.read_csv(data_dir / "support/labels.csv", infer_schema=False)
    evals = pl.read_csv(data_dir / "support/eval.csv", infer_schema=False)
    joined = messages.join(labels, on="message_id", how="left")

    print(f"rows: messages={messages.height} labels={labels.height} eval={evals.height}")
    for name, frame in (("eval.csv", evals), ("messages.csv", joined)):
        for field, values in (("intent", INTENTS), ("urgency", URGENCIES)):
            credit = [
                rule_credit(rendered_user_message(ch, body), values, truth)
                for ch, body, truth in frame.select("channel", "body", field).iter_rows()
            ]
            print(f"rule accuracy  {name:<13} {field:<8} {sum(credit) / len(credit):.3f}")
    for name, frame in (("messages.csv", messages), ("eval.csv", evals)):
        tokens = [count_tokens(b) for b in frame["body"]]
        words = [len(b.split()) for b in frame["body"]]
        pct = _percentiles(tokens, (50, 90, 95, 99))
        print(
            f"tokens         {name:<13} p50={pct[50]} p90={pct[90]} p95={pct[95]} p99={pct[99]} "
            f"max={max(tokens)}; >1024: {sum(t > 1024 for t in tokens)}, "
            f">=3000: {sum(t >= 3000 for t in tokens)}, 300-1000 words: "
            f"{sum(300 <= w <= 1000 for w in words)}"
        )
    bodies = messages["body"].to_list()
    exact = len(bodies) - len(set(bodies))
    near = len(set(bodies)) - len({normalized(b) for b in bodies})
    print(f"duplicates     messages.csv  exact={exact} whitespace/case-only={near}")
    print(
        f"intents        messages.csv  {dict(sorted(labels['intent'].value_counts().iter_rows()))}"
    )
    print(
        f"urgency        messages.csv  {dict(sorted(labels['urgency'].value_counts().iter_rows()))}"
    )
    hits = neutral_bank_hits()
    print(f"neutral phrases with a label keyword: {len(hits)}")
    for bank, text, found in hits:
        print(f"  {bank}: {text!r} -> {found}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=DATA_DIR, help="folder to write (default: data/)"
    )
    parser.add_argument(
        "--check", action="store_true", help="print statistics of the files in --out"
    )
    args = parser.parse_args(argv)
    if args.check:
        check(args.out)
        return 0
    written = write_all(args.out)
    print(f"wrote {len(written)} file(s) under {args.out}" if written else "all files up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
